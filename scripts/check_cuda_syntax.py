# SPDX-License-Identifier: Apache-2.0
"""Compile check of the native op's CUDA-only sources on a machine without CUDA (``g++ -fsyntax-only``).

    python scripts/check_cuda_syntax.py            # exit 0: compiles; 1: does not; 3: cannot check here

The CUDA kernel (``csrc/compile/cast_all_gather_cuda.cpp``) is plain C++ against c10/ATen's CUDA API, built
by the host compiler in a CUDA build. A CPU build of torch ships those headers but not the CUDA runtime's
(``cuda_runtime_api.h``, ``crt/host_config.h``) nor the generated ``c10/cuda/impl/cuda_cmake_macros.h``. This
script unpacks the headers of two pinned NVIDIA wheels from PyPI (downloaded once, ``--no-deps``, never
installed) into ``build/cuda_headers/``, writes a stand-in for the generated header there, and compiles every
source that ``NativeOpBuilder`` adds for CUDA, with the flags it and ``torch.utils.cpp_extension`` would pass.

What this proves: the CUDA source parses and type-checks against this torch's headers. What it does not:
that it links against libc10_cuda / libtorch_cuda, or that it runs. Exit 3 (headers cannot be fetched, no
C++ compiler) says why on stderr, so a caller can tell "cannot check here" from "does not compile".
"""
import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path
from typing import List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from benchmarks.checkout import use_checkout  # noqa: E402

use_checkout()  # this checkout's deepspeed.compile, before deepspeed is imported

# Headers only; the versions are pinned so that every run checks against the same CUDA API.
CUDA_HEADER_WHEELS = ("nvidia-cuda-runtime-cu12==12.9.79",  # cuda_runtime_api.h, cuda.h, ...
                      "nvidia-cuda-nvcc-cu12==12.9.86")  # crt/host_config.h (included by cuda_runtime_api.h)
HEADER_DIRS = ("nvidia/cuda_runtime/include", "nvidia/cuda_nvcc/include")
DEFAULT_CACHE = REPO_ROOT / "build" / "cuda_headers"
# What CMake generates from c10/cuda/impl/cuda_cmake_macros.h.in for a shared-library CUDA build of torch.
MACROS_STANDIN = ("#pragma once\n// Stand-in for torch's generated header (absent from CPU builds); "
                  "written by scripts/check_cuda_syntax.py.\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
# torch.utils.cpp_extension (torch 2.13) compiles extensions with -std=c++20.
CXX_STD = "-std=c++20"
EXIT_OK, EXIT_COMPILE_ERROR, EXIT_UNAVAILABLE = 0, 1, 3


class HeadersUnavailable(RuntimeError):
    """The check cannot run here (no network for the wheels, no C++ compiler); the message says why."""


def fetch_cuda_headers(cache: Path = DEFAULT_CACHE) -> List[Path]:
    """Include directories of the CUDA runtime headers, unpacked under ``cache`` (downloaded on first use)."""
    unpacked = cache / "unpacked"
    stamp = unpacked / "wheels.txt"
    wanted = "\n".join(CUDA_HEADER_WHEELS) + "\n"
    if not (stamp.is_file() and stamp.read_text() == wanted):
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   "--timeout", "30", "--retries", "2", "--dest", tmp, *CUDA_HEADER_WHEELS]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise HeadersUnavailable(f"could not download {' '.join(CUDA_HEADER_WHEELS)}: "
                                         f"{(proc.stderr or proc.stdout).strip()[-1500:]}")
            staging = Path(tmp) / "unpacked"
            for wheel in sorted(Path(tmp).glob("*.whl")):
                with zipfile.ZipFile(wheel) as zf:
                    zf.extractall(staging, [m for m in zf.namelist() if "/include/" in m])
            (staging / "wheels.txt").write_text(wanted)
            shutil.rmtree(unpacked, ignore_errors=True)
            os.replace(staging, unpacked)  # complete or absent, also with a concurrent run
    dirs = [unpacked / d for d in HEADER_DIRS]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise HeadersUnavailable(f"the wheels did not contain {', '.join(missing)}")
    return dirs


def write_macros_standin(cache: Path = DEFAULT_CACHE) -> Path:
    """An include directory holding the stand-in ``c10/cuda/impl/cuda_cmake_macros.h``."""
    root = cache / "standin"
    header = root / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    header.parent.mkdir(parents=True, exist_ok=True)
    if not header.is_file() or header.read_text() != MACROS_STANDIN:
        header.write_text(MACROS_STANDIN)
    return root


def _builder(with_cuda: bool):
    """``NativeOpBuilder`` as it is configured where torch does (or does not) see a GPU with a CUDA toolkit."""
    from deepspeed.compile.native.builder import NativeOpBuilder

    class Builder(NativeOpBuilder):
        def with_cuda(self) -> bool:
            return with_cuda

    return Builder()


def cuda_only_sources() -> List[Path]:
    """The sources that ``NativeOpBuilder`` compiles only in a CUDA build."""
    cpu_sources = _builder(with_cuda=False).sources()
    sources = [Path(s) for s in _builder(with_cuda=True).sources() if s not in cpu_sources]
    if not sources:
        raise RuntimeError("NativeOpBuilder lists no CUDA-only source (were the sources found?)")
    return sources


def compile_command(source: Path, cuda_includes: Sequence[Path], standin: Path, deps_file: Path) -> List[str]:
    """The host-compiler command of ``source`` in a CUDA build, with ``-fsyntax-only``; the headers it
    included are listed in ``deps_file``."""
    import torch
    from torch.utils.cpp_extension import include_paths

    builder = _builder(with_cuda=True)
    # As torch.utils.cpp_extension.load: the op's own includes with -I, torch/CUDA/Python ones with -isystem.
    system = [*include_paths("cpu"), str(standin), *map(str, cuda_includes), sysconfig.get_path("include")]
    return [os.environ.get("CXX", "c++"), "-fsyntax-only", "-MD", "-MF", str(deps_file), CXX_STD, "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DTORCH_EXTENSION_NAME={builder.NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            *builder.cxx_args(), "-UC10_USE_GLOG",  # as NativeOpBuilder.jit_load passes them
            *[f"-I{p}" for p in builder.include_paths()],
            *[arg for p in system for arg in ("-isystem", p)],
            str(source)]


def check(cache: Path = DEFAULT_CACHE, verbose: bool = False) -> int:
    """Compile every CUDA-only source; prints the compiler's diagnostics; returns an exit status."""
    compiler = os.environ.get("CXX", "c++")
    try:
        if shutil.which(compiler) is None:
            raise HeadersUnavailable(f"no C++ compiler: '{compiler}' is not on PATH (set CXX)")
        cuda_includes = fetch_cuda_headers(cache)
    except HeadersUnavailable as err:
        print(f"check_cuda_syntax: cannot check here: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    standin = write_macros_standin(cache)
    status = EXIT_OK
    for source in cuda_only_sources():
        deps_file = cache / "deps" / f"{source.stem}.d"
        deps_file.parent.mkdir(parents=True, exist_ok=True)
        deps_file.unlink(missing_ok=True)
        cmd = compile_command(source, cuda_includes, standin, deps_file)
        if verbose:
            print(" ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        rel = source.relative_to(REPO_ROOT) if source.is_relative_to(REPO_ROOT) else source
        # A source whose CUDA code is guarded by a macro the builder does not define compiles to nothing:
        # it must have included the CUDA runtime's headers for the check to mean anything.
        used_cuda = deps_file.is_file() and str(cuda_includes[0] / "cuda_runtime_api.h") in deps_file.read_text()
        if proc.returncode != 0:
            print(f"check_cuda_syntax: FAILED: {rel} does not compile as in a CUDA build", file=sys.stderr)
            status = EXIT_COMPILE_ERROR
        elif not used_cuda:
            print(f"check_cuda_syntax: FAILED: {rel} compiled without including any CUDA header: is its CUDA "
                  f"code guarded by a macro that NativeOpBuilder.cxx_args() does not define?", file=sys.stderr)
            status = EXIT_COMPILE_ERROR
        else:
            print(f"check_cuda_syntax: {rel} compiles as in a CUDA build ({compiler} -fsyntax-only {CXX_STD} "
                  f"{' '.join(a for a in _builder(with_cuda=True).cxx_args() if a.startswith('-D'))})")
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the CUDA headers are kept")
    p.add_argument("-v", "--verbose", action="store_true", help="print the compiler command")
    args = p.parse_args(argv)
    return check(args.cache.resolve(), args.verbose)


if __name__ == "__main__":
    sys.exit(main())

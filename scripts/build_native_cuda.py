# SPDX-License-Identifier: Apache-2.0
"""Build the native op's CUDA path for real on a machine without a GPU: compiled, linked, loaded, registered.

    python scripts/build_native_cuda.py            # exit 0: all of it holds; 1: something failed; 3: cannot here
    python scripts/build_native_cuda.py --env      # the environment of such a build, as shell exports

It needs a CUDA build of torch and the CUDA runtime's headers: ``bash scripts/setup_torch_env.sh 2.14.1`` makes
its venv (torch 2.14.1 for CUDA 13 with its CUDA runtime libraries, and ``nvidia-cuda-crt``'s
headers beside them). Run by a Python whose torch is not a CUDA build, the script runs itself again with that
venv's Python where it exists.

``NativeOpBuilder`` then builds as it would on a GPU machine (``DEEPSPEED_COMPILE_NATIVE_CUDA=1`` stands in for the
GPU it cannot see): ``dsc_native.cpp``, the CPU kernel and ``cast_all_gather_cuda.cpp`` with ``-DDSC_WITH_CUDA``,
against torch's CUDA headers and the CUDA runtime's, linked against ``libc10_cuda``, ``libtorch_cuda`` and
``libcudart``. In a fresh process the library is loaded, and the script checks that both ops have a kernel for
the ``CUDA`` dispatch key and for ``CPU``, that the three CUDA libraries are on the link line and the library needs
those whose symbols its kernels use (``libc10_cuda``, ``libcudart``: the linker drops an unused one), and that the CPU
kernel of this build gathers bitwise what the Python path does (one gloo rank). What it does not show: that the
CUDA kernel runs (``scripts/gpu_check.sh`` on a GPU machine).

CUDA_HOME is a folder in the venv that lays the wheels' files out as a toolkit is laid out (``include/``,
``lib64/libcudart.so``): the wheels ship ``libcudart.so.13`` only, and the linker's ``-lcudart`` wants the
unversioned name.
"""
import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
CUDA_TORCH = "2.14.1"  # the CUDA build of torch on these machines' disk
# where scripts/setup_torch_env.sh puts that torch's venv
VENV = Path(os.environ.get("DEEPSPEED_COMPILE_VENVS", Path.home() / ".cache" / "deepspeed-compile")) / \
    f"venv-torch-{CUDA_TORCH}"
FORCE_CUDA_ENV = "DEEPSPEED_COMPILE_NATIVE_CUDA"  # deepspeed/compile/native/builder.py
OPS = ("dsc_native::cast_all_gather", "dsc_native::cast_all_gather_start")
CUDA_LIBRARIES = ("libc10_cuda.so", "libtorch_cuda.so", "libcudart.so")  # on the link line
USED_LIBRARIES = ("libc10_cuda.so", "libcudart.so")  # and needed by the library: the kernels call into these
# the headers a CUDA build includes first (runtime wheel) and the one only nvidia-cuda-crt ships
NEEDED_HEADERS = ("cuda_runtime_api.h", "crt/host_config.h")
EXIT_OK, EXIT_FAILED, EXIT_UNAVAILABLE = 0, 1, 3


class Unavailable(RuntimeError):
    """The build cannot be tried here; the message says why and what to run."""


def cuda_home() -> Path:
    """A toolkit-shaped CUDA_HOME over the CUDA wheels next to this torch, made under ``build/`` on first use."""
    import torch
    if not torch.version.cuda:
        raise Unavailable(f"torch {torch.__version__} is not a CUDA build")
    major = torch.version.cuda.split(".")[0]
    site = Path(torch.__file__).resolve().parent.parent
    wheels = site / "nvidia" / f"cu{major}"
    missing = [h for h in NEEDED_HEADERS if not (wheels / "include" / h).is_file()]
    if missing:
        raise Unavailable(f"the CUDA headers {', '.join(missing)} are not in {wheels / 'include'} "
                          f"(bash scripts/setup_torch_env.sh {CUDA_TORCH} installs nvidia-cuda-crt)")
    runtime = sorted((wheels / "lib").glob("libcudart.so.*"))
    if not runtime:
        raise Unavailable(f"no libcudart.so.* in {wheels / 'lib'}")
    home = Path(sys.prefix) / f"cuda_home-{torch.version.cuda}"  # beside the venv's build of the op: one per venv
    (home / "lib64").mkdir(parents=True, exist_ok=True)
    for link, target in ((home / "include", wheels / "include"), (home / "lib64" / "libcudart.so", runtime[0])):
        if not (link.is_symlink() and link.resolve() == target.resolve()):
            link.unlink(missing_ok=True)
            link.symlink_to(target)
    return home


def build_env() -> Dict[str, str]:
    """What a process needs to build and load the CUDA path here."""
    import torch
    home = cuda_home()
    extensions = Path(sys.prefix) / "torch_extensions"
    lib_dirs = [str(Path(torch.__file__).resolve().parent / "lib"), str(home / "lib64")]
    # torch reads the GPU's architecture for nvcc's flags, and with no GPU needs it named (no .cu source is compiled:
    # the CUDA kernel is host C++ against c10's CUDA API)
    return {FORCE_CUDA_ENV: "1", "CUDA_HOME": str(home), "TORCH_EXTENSIONS_DIR": str(extensions),
            "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"),
            "LD_LIBRARY_PATH": os.pathsep.join(lib_dirs + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(
                os.pathsep) if p])}


# ----- run in the child process, with build_env() set ---------------------------------------------------------
def _needed_libraries(library: str) -> List[str]:
    """The shared libraries ``library`` names as needed (its ELF dynamic section)."""
    out = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


def _link_flags(ninja_file: Path) -> List[str]:
    """The link flags torch's extension build wrote for the library."""
    for line in ninja_file.read_text().splitlines():
        if line.startswith("ldflags ="):
            return line.split("=", 1)[1].split()
    return []


def _bitwise_against_python() -> List[str]:
    """The CPU kernel of this build against the Python cast + all-gather, on one gloo rank."""
    import tempfile
    import torch
    import torch.distributed as dist
    from deepspeed.compile.native import cast_all_gather_python, load_native
    native = load_native("native")
    with tempfile.TemporaryDirectory() as tmp:  # the store removes its file when the group goes
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            checked = []
            for dtype in (torch.float32, torch.bfloat16, torch.float16, None):
                shard = torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 3.0
                out, ref = native(shard, dtype, None, 1), cast_all_gather_python(shard, dtype, None, 1)
                if out.dtype != ref.dtype or not torch.equal(out.view(torch.uint8), ref.view(torch.uint8)):
                    raise AssertionError(f"the CPU kernel gathers other bits than the Python path ({dtype})")
                checked.append(str(dtype))
            return checked
        finally:
            dist.destroy_process_group()


def child() -> int:
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.checkout import use_checkout
    use_checkout()  # this checkout's deepspeed.compile, before deepspeed is imported
    import torch
    from deepspeed.compile.native.builder import NativeOpBuilder
    builder = NativeOpBuilder()
    if not builder.with_cuda():
        print("build_native_cuda: FAILED: NativeOpBuilder does not build the CUDA path here", file=sys.stderr)
        return EXIT_FAILED
    sources = [Path(s).name for s in builder.sources()]
    library = builder.load(verbose=False)
    print(f"build_native_cuda: built {', '.join(sources)} with {' '.join(builder.cxx_args())} into {library}")
    problems = []
    ldflags = _link_flags(Path(library).parent / "build.ninja")
    for name in CUDA_LIBRARIES:
        flag = "-l" + name[len("lib"):-len(".so")]
        if flag not in ldflags:
            problems.append(f"the link line lacks {flag}: {' '.join(ldflags)}")
    # the linker keeps (--as-needed) the libraries whose symbols the kernels use: c10's CUDA API and the runtime
    needed = _needed_libraries(library)
    for name in USED_LIBRARIES:
        if not any(n == name or n.startswith(name + ".") for n in needed):
            problems.append(f"the library does not need {name} (needs: {', '.join(needed)})")
    for op in OPS:
        for key in ("CUDA", "CPU"):
            if not torch._C._dispatch_has_kernel_for_dispatch_key(op, key):
                problems.append(f"{op} has no kernel for the {key} dispatch key")
    if not problems:
        checked = _bitwise_against_python()
        print(f"build_native_cuda: linked with {' '.join(f for f in ldflags if 'cud' in f)}, needs "
              f"{', '.join(n for n in needed if 'cud' in n)}; loaded; "
              f"{' and '.join(OPS)} have CUDA and CPU kernels; the CPU kernel is bitwise the Python path "
              f"({', '.join(checked)})")
    for problem in problems:
        print(f"build_native_cuda: FAILED: {problem}", file=sys.stderr)
    return EXIT_FAILED if problems else EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", action="store_true", help="print the build's environment as shell exports")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child()
    import torch
    if not torch.version.cuda:
        python = VENV / "bin" / "python"
        if python.is_file() and Path(sys.prefix).resolve() != VENV.resolve():
            return subprocess.run([str(python), __file__, *(argv if argv is not None else sys.argv[1:])]).returncode
        print(f"build_native_cuda: cannot check here: torch {torch.__version__} is not a CUDA build and {VENV} does "
              f"not exist (bash scripts/setup_torch_env.sh {CUDA_TORCH})", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        env = build_env()
    except Unavailable as err:
        print(f"build_native_cuda: cannot check here: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if args.env:
        print("\n".join(f"export {k}='{v}'" for k, v in env.items()))
        return EXIT_OK
    return subprocess.run([sys.executable, __file__, "--child"], env=dict(os.environ, **env)).returncode


if __name__ == "__main__":
    sys.exit(main())

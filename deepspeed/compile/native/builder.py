# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed op builder of the ``dsc_native`` ops (``csrc/compile/``): JIT-built with ninja at first use.

``NativeOpBuilder().load()`` compiles the C++ sources into ``$TORCH_EXTENSIONS_DIR/deepspeed_compile_native/``
(DeepSpeed's usual JIT cache; torch's default is ``~/.cache/torch_extensions``) and loads the shared library
into the process, which registers the ``torch.ops.dsc_native`` ops. The library is a plain ``TORCH_LIBRARY``
library, not a Python module, so it is loaded with ``is_python_module=False``; later loads only re-check the
cache (ninja) and are quick. The CUDA kernel is compiled only where torch is a CUDA build, ``CUDA_HOME`` is set,
and torch sees a GPU (or ``DEEPSPEED_COMPILE_NATIVE_CUDA=1`` asks for it).
"""
import logging
import os
import shutil
import time
from pathlib import Path
from typing import List, Optional

from deepspeed.ops.op_builder.builder import OpBuilder

logger = logging.getLogger(__name__)

# Where the sources are: an installed copy carries them inside the package (``<package>/csrc/compile``);
# a source checkout keeps them at the repository root (``deepspeed/compile/../../csrc/compile``).
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_SOURCE_DIR_CANDIDATES = (_PACKAGE_DIR / "csrc" / "compile", _PACKAGE_DIR.parent.parent / "csrc" / "compile")
_COMMON_SOURCES = ("dsc_native.cpp", "cast_all_gather_cpu.cpp")
_CUDA_SOURCES = ("cast_all_gather_cuda.cpp", )
_HEADERS = ("dsc_native.h", )
# builds the CUDA kernel in where torch sees no GPU (a CUDA build of torch and CUDA_HOME are still needed)
FORCE_CUDA_ENV = "DEEPSPEED_COMPILE_NATIVE_CUDA"


def find_source_dir() -> Optional[Path]:
    """The first directory of ``_SOURCE_DIR_CANDIDATES`` that holds every source and header, else None."""
    needed = _COMMON_SOURCES + _CUDA_SOURCES + _HEADERS
    for candidate in _SOURCE_DIR_CANDIDATES:
        if all((candidate / name).is_file() for name in needed):
            return candidate
    return None


class NativeOpBuilder(OpBuilder):
    """Builds and loads the ``dsc_native`` ``TORCH_LIBRARY`` ops (fused cast + all-gather)."""

    BUILD_VAR = "DS_BUILD_DEEPSPEED_COMPILE_NATIVE"
    NAME = "deepspeed_compile_native"

    def __init__(self, name: Optional[str] = None) -> None:
        super().__init__(name=self.NAME if name is None else name)

    def absolute_name(self) -> str:
        return f"deepspeed.compile.native.{self.NAME}_op"

    # ----- what is compiled ------------------------------------------------------------------------------
    def with_cuda(self) -> bool:
        """Whether the CUDA kernel is compiled in: a CUDA build of torch and a CUDA toolkit (``CUDA_HOME``), and a GPU
        torch can see, or ``FORCE_CUDA_ENV=1`` (a build without a GPU: ``scripts/build_native_cuda.py``)."""
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
        wanted = torch.cuda.is_available() or os.environ.get(FORCE_CUDA_ENV) == "1"
        return wanted and torch.version.cuda is not None and CUDA_HOME is not None

    def sources(self) -> List[str]:
        """Absolute paths of the C++ sources (the base class would resolve relative ones against DeepSpeed)."""
        source_dir = find_source_dir()
        if source_dir is None:
            return []
        names = _COMMON_SOURCES + (_CUDA_SOURCES if self.with_cuda() else ())
        return [str(source_dir / name) for name in names]

    def include_paths(self) -> List[str]:
        source_dir = find_source_dir()
        return [] if source_dir is None else [str(source_dir)]

    def cxx_args(self) -> List[str]:
        # -Wno-deprecated-declarations: c10d headers mark their older collective names deprecated.
        args = ["-O3", "-Wno-deprecated-declarations"]
        if self.with_cuda():
            args.append("-DDSC_WITH_CUDA")
        return args

    def nvcc_args(self) -> List[str]:
        return ["-DDSC_WITH_CUDA"] if self.with_cuda() else []

    # ----- can it be built -------------------------------------------------------------------------------
    def incompatibility_reasons(self) -> List[str]:
        """Why this op cannot be built here (empty when it can): the reasons are shown to the user."""
        reasons = []
        try:
            import torch
            import torch.distributed
            from torch.utils.cpp_extension import include_paths as torch_include_paths
        except ImportError as err:
            return [f"torch is not importable ({err})"]
        if not torch.distributed.is_available():
            reasons.append("torch was built without torch.distributed (c10d)")
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            reasons.append(f"no C++ compiler: '{compiler}' is not on PATH (set CXX)")
        registry_header = os.path.join("torch", "csrc", "distributed", "c10d", "GroupRegistry.hpp")
        if not any(os.path.isfile(os.path.join(path, registry_header)) for path in torch_include_paths()):
            reasons.append(f"torch's C++ headers are not installed ({registry_header} not found)")
        if find_source_dir() is None:
            reasons.append("the op's C++ sources were not found in any of "
                           + ", ".join(str(p) for p in _SOURCE_DIR_CANDIDATES))
        if shutil.which("ninja") is None:
            reasons.append("ninja is not installed (pip install ninja)")
        return reasons

    def is_compatible(self, verbose: bool = False) -> bool:
        reasons = self.incompatibility_reasons()
        if reasons:
            self.error_log = "; ".join(reasons)
            if verbose:
                self.warning(f"{self.name} cannot be built: {self.error_log}")
        return not reasons and super().is_compatible(verbose)

    # ----- build and load --------------------------------------------------------------------------------
    def jit_load(self, verbose: bool = False) -> str:
        """Build (or find in the cache) and load the library; returns its path.

        ``OpBuilder.load`` comes here (this op is never pre-installed). The base ``jit_load`` imports the
        result as a Python module; a ``TORCH_LIBRARY`` library has none, so it is loaded as a plain library.
        """
        if not self.is_compatible(verbose):
            raise RuntimeError(f"Unable to JIT load the {self.name} op: {self.error_log}")
        from torch.utils.cpp_extension import load

        start = time.time()
        library_path = load(name=self.name,
                            sources=self.sources(),
                            extra_include_paths=self.include_paths(),
                            extra_cflags=self.cxx_args() + ["-UC10_USE_GLOG"],
                            extra_cuda_cflags=self.nvcc_args(),
                            extra_ldflags=self.strip_empty_entries(self.extra_ldflags()),
                            with_cuda=self.with_cuda(),
                            is_python_module=False,
                            verbose=verbose)
        logger.info("%s op loaded from %s in %.1f s", self.name, library_path, time.time() - start)
        OpBuilder._loaded_ops[self.name] = library_path
        return library_path

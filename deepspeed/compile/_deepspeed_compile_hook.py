# SPDX-License-Identifier: Apache-2.0
"""Import-precedence hook that answers for ``deepspeed.compile`` with deepspeed-compile's package.

Installed as the top-level module ``_deepspeed_compile_hook`` and activated at interpreter start by
``deepspeed_compile-precedence.pth`` (the same mechanism as setuptools' ``distutils-precedence.pth``).
Only the name ``deepspeed.compile`` is redirected; its submodules resolve through the package
``__path__``. Stock DeepSpeed's files are never touched.

``DEEPSPEED_COMPILE_MODULE`` chooses, at the time ``deepspeed.compile`` is first imported:
  unset / ``ours``   the installed deepspeed-compile package;
  ``stock``          DeepSpeed's own ``deepspeed.compile`` (the hook steps aside);
  a directory path   that directory as the package (a source checkout, used by the test suite).
"""
import importlib.machinery
import importlib.util
import os
import sys
import warnings

MODULE_NAME = "deepspeed.compile"
ENV_VAR = "DEEPSPEED_COMPILE_MODULE"
_INSTALLED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_compile")


def package_dir() -> "str | None":
    """The directory to load ``deepspeed.compile`` from, or None for DeepSpeed's own module."""
    choice = os.environ.get(ENV_VAR, "").strip()
    if choice == "stock":
        return None
    if choice in ("", "ours"):
        return _INSTALLED_DIR if os.path.isfile(os.path.join(_INSTALLED_DIR, "__init__.py")) else None
    if os.path.isfile(os.path.join(choice, "__init__.py")):
        return os.path.abspath(choice)
    warnings.warn(f"{ENV_VAR}={choice!r} is neither 'stock', 'ours' nor a package directory; "
                  "using the installed deepspeed-compile", RuntimeWarning, stacklevel=2)
    return _INSTALLED_DIR if os.path.isfile(os.path.join(_INSTALLED_DIR, "__init__.py")) else None


class DeepSpeedCompileFinder:
    """A meta-path finder that answers for ``deepspeed.compile`` only."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != MODULE_NAME:
            return None
        directory = package_dir()
        if directory is None:
            return None
        return importlib.util.spec_from_file_location(MODULE_NAME,
                                                      os.path.join(directory, "__init__.py"),
                                                      submodule_search_locations=[directory])


def install() -> None:
    """Put the finder first on ``sys.meta_path``; idempotent, replaces an older copy of itself."""
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "__name__", "") != "DeepSpeedCompileFinder"]
    sys.meta_path.insert(0, DeepSpeedCompileFinder)


def use_source_checkout(package: str, build_dir: str) -> None:
    """Answer for ``deepspeed.compile`` with the source package at ``package`` in this process and the processes it
    starts (through ``DEEPSPEED_COMPILE_MODULE``), unless ``stock`` was chosen; the test suite and the benchmark of
    a source checkout run this before anything imports ``deepspeed``. JIT builds (DeepSpeed's CPU comm op, the
    native op) and inductor's cache stay under ``build_dir``: torch's extension cache is keyed by op name only, so
    a cache shared with other environments could hand back another checkout's build."""
    if os.environ.get(ENV_VAR) != "stock":
        os.environ[ENV_VAR] = package
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(build_dir, "torch_extensions"))
    # TORCHINDUCTOR_COMPILE_THREADS stays torch's (a worker pool for inductor's C++ kernels): compiled in-process,
    # two ranks serialized on the kernel cache's file locks (both build the same kernels; one waits while the other
    # runs gcc; docs/history/2026-12-04.md, "Test set-up: inductor's kernels compile in torch's worker pool")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(build_dir, "inductor_cache"))
    install()

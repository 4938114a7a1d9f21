"""Make ``deepspeed.compile`` resolve to this checkout's package, installed or not.

Imported by ``conftest.py`` and by every spawned rank before anything imports ``deepspeed``. The
choice travels to child processes through ``DEEPSPEED_COMPILE_MODULE`` (read when ``deepspeed.compile`` is
first imported); ``DEEPSPEED_COMPILE_MODULE=stock`` is respected so the stock module can be tested too.
"""
import importlib.util
import os
import sys
import warnings

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PACKAGE_DIR = os.path.join(REPO_ROOT, "deepspeed", "compile")


def use_checkout() -> None:
    if os.environ.get("DEEPSPEED_COMPILE_MODULE") != "stock":
        os.environ["DEEPSPEED_COMPILE_MODULE"] = PACKAGE_DIR
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed JIT-builds its CPU comm op on first use; keep the build inside the checkout, not in a cache
    # shared with other environments (torch's cache is keyed by op name only).
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO_ROOT, "build", "torch_extensions"))
    # inductor: compile in-process (two ranks on two cores gain nothing from worker pools), and keep its cache
    # inside the checkout so repeated local runs reuse generated kernels
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(REPO_ROOT, "build", "inductor_cache"))
    if "_deepspeed_compile_hook" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_deepspeed_compile_hook",
                                                      os.path.join(PACKAGE_DIR, "_deepspeed_compile_hook.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["_deepspeed_compile_hook"] = module
    sys.modules["_deepspeed_compile_hook"].install()
    # torch 2.13 warns on every all_gather_into_tensor / reduce_scatter_tensor call from DeepSpeed's comm layer.
    warnings.filterwarnings("ignore", category=FutureWarning)


use_checkout()

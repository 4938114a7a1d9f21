# SPDX-License-Identifier: Apache-2.0
"""Make ``deepspeed.compile`` resolve to this checkout's package, installed or not, for the benchmark processes.

Each benchmark script puts the repository root on ``sys.path`` and calls :func:`use_checkout` before anything
imports ``deepspeed``. The choice travels to child processes (launcher ranks) through ``DEEPSPEED_COMPILE_MODULE``
(read when ``deepspeed.compile`` is first imported); ``DEEPSPEED_COMPILE_MODULE=stock`` is respected so the stock
module can be benchmarked too. The test suite has its own copy (``tests/unit/compile/checkout.py``): the two trees
import nothing from each other.
"""
import importlib.util
import os
import sys
import warnings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(REPO_ROOT, "deepspeed", "compile")


def use_checkout() -> None:
    # the checkout's own hook, in place of any installed copy (whose finder it replaces)
    spec = importlib.util.spec_from_file_location("_deepspeed_compile_hook",
                                                  os.path.join(PACKAGE_DIR, "_deepspeed_compile_hook.py"))
    sys.modules["_deepspeed_compile_hook"] = hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    hook.use_source_checkout(PACKAGE_DIR, os.path.join(REPO_ROOT, "build"))
    # torch 2.13 warns on every all_gather_into_tensor / reduce_scatter_tensor call from DeepSpeed's comm layer.
    warnings.filterwarnings("ignore", category=FutureWarning)

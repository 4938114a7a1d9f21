# SPDX-License-Identifier: Apache-2.0
"""Make ``deepspeed.compile`` resolve to this checkout's package, installed or not.

Imported by ``conftest.py`` and by every spawned rank before anything imports ``deepspeed``. The
choice travels to child processes through ``DEEPSPEED_COMPILE_MODULE`` (read when ``deepspeed.compile`` is
first imported); ``DEEPSPEED_COMPILE_MODULE=stock`` is respected so the stock module can be tested too.
"""
import importlib.util
import os
import sys
import warnings

# MKL's matrix products may round differently for the same values at different memory alignments (conditional numerical
# reproducibility off, MKL's default; seen on AMD EPYC, where one ZeRO-2 weight gradient differed from eager ZeRO-2's
# by one ulp in one element, on either transport, whichever way the graph computed it). The tests compare DeepCompile with eager ZeRO bit for bit, so every process
# they start uses MKL's strict mode, read at MKL's first call: set here, before anything imports torch.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
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


use_checkout()

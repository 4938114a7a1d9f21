# SPDX-License-Identifier: Apache-2.0
"""What can be checked of the CUDA path without a GPU: the kernel compiles, and the GPU check is ready to run.

``scripts/check_cuda_syntax.py`` compiles ``csrc/compile/cast_all_gather_cuda.cpp`` as a CUDA build would
(headers from pinned NVIDIA wheels, fetched once into ``build/cuda_headers``). It runs in CI: when the headers
cannot be fetched the test fails there (``CI=true``) and skips, saying why, elsewhere.
``scripts/gpu_check.sh`` / ``scripts/gpu_check.py`` run on a GPU machine; here they must parse, import, and
refuse cleanly.
"""
import os
import subprocess
import sys

from checkout import REPO_ROOT
from machine import unavailable_here

SCRIPTS = os.path.join(REPO_ROOT, "scripts")
EXIT_COMPILE_ERROR, EXIT_UNAVAILABLE = 1, 3  # scripts/check_cuda_syntax.py's exit statuses


def _run(cmd, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def test_cuda_kernel_compiles() -> None:
    proc = _run([sys.executable, os.path.join(SCRIPTS, "check_cuda_syntax.py")])
    output = proc.stdout + proc.stderr
    if proc.returncode == EXIT_UNAVAILABLE:
        unavailable_here("cuda_check", output.strip())
    assert proc.returncode == 0, f"the CUDA kernel does not compile (exit {proc.returncode}):\n{output}"
    assert "cast_all_gather_cuda.cpp compiles as in a CUDA build" in proc.stdout, output


def test_check_says_when_it_cannot_run(tmp_path) -> None:
    # no package index: the headers cannot be fetched, which is "cannot check here" (3), not "does not compile" (1)
    proc = _run([sys.executable, os.path.join(SCRIPTS, "check_cuda_syntax.py"), "--cache", str(tmp_path)],
                env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}, timeout=120)
    assert proc.returncode == EXIT_UNAVAILABLE, proc.stdout + proc.stderr
    assert "check_cuda_syntax: cannot check here: could not download nvidia-cuda-runtime-cu12" in proc.stderr


def test_gpu_check_script_parses() -> None:
    proc = _run(["bash", "-n", os.path.join(SCRIPTS, "gpu_check.sh")])
    assert proc.returncode == 0, proc.stderr


def test_gpu_check_refuses_without_gpu() -> None:
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on a GPU machine too
    proc = _run([sys.executable, os.path.join(SCRIPTS, "gpu_check.py")], env={"CUDA_VISIBLE_DEVICES": ""},
                timeout=120)
    assert proc.returncode != 0
    assert "gpu_check: needs an NVIDIA GPU" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr  # a clean refusal, not a crash

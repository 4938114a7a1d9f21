# SPDX-License-Identifier: Apache-2.0
"""What can be checked of the CUDA path without a GPU: the native op is built with it for real, and the GPU check is
ready to run.

``scripts/build_native_cuda.py`` builds the op as a GPU machine would (``-DDSC_WITH_CUDA``, the CUDA kernel, linked
against torch's and the runtime's CUDA libraries) with the CUDA build of torch 2.14.1 that
``scripts/setup_torch_env.sh 2.14.1`` installs in a venv of its own, loads it in a process without a GPU, and checks
that both ops have a CUDA kernel. ``.ci/run`` makes that venv first; where it does not exist the test fails under CI
(``CI=true``) and skips, saying why, elsewhere. ``scripts/gpu_check.sh`` / ``scripts/gpu_check.py`` run on a GPU
machine; here they must parse, import, and refuse cleanly.
"""
import os
import subprocess
import sys

from checkout import REPO_ROOT
from machine import unavailable_here

SCRIPTS = os.path.join(REPO_ROOT, "scripts")
EXIT_FAILED, EXIT_UNAVAILABLE = 1, 3  # scripts/build_native_cuda.py's exit statuses


def _run(cmd, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def test_cuda_path_builds_links_loads_and_registers_its_kernels() -> None:
    # a build from nothing takes minutes on 2 cores; the cached one a few seconds
    proc = _run([sys.executable, os.path.join(SCRIPTS, "build_native_cuda.py")], timeout=900)
    output = proc.stdout + proc.stderr
    if proc.returncode == EXIT_UNAVAILABLE:
        unavailable_here("cuda_check", output.strip())
    assert proc.returncode == 0, f"the CUDA build failed (exit {proc.returncode}):\n{output}"
    for expected in ("built dsc_native.cpp, cast_all_gather_cpu.cpp, cast_all_gather_cuda.cpp with",
                     "-DDSC_WITH_CUDA", "-lc10_cuda -ltorch_cuda", "-lcudart", "needs libc10_cuda.so, libcudart.so",
                     "dsc_native::cast_all_gather and dsc_native::cast_all_gather_start have CUDA and CPU kernels",
                     "the CPU kernel is bitwise the Python path"):
        assert expected in proc.stdout, (expected, output)


def test_build_says_when_it_cannot_run(tmp_path, monkeypatch, capsys) -> None:
    # a CPU build of torch and no venv with a CUDA build: "cannot build here" (3), not "failed" (1)
    import importlib.util
    import torch
    spec = importlib.util.spec_from_file_location("build_native_cuda", os.path.join(SCRIPTS, "build_native_cuda.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(script, "VENV", tmp_path / "venv-torch-none")
    assert script.main([]) == EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert "build_native_cuda: cannot check here: torch" in err and "is not a CUDA build" in err, err
    assert "setup_torch_env.sh 2.14.1" in err, err


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

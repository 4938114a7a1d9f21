#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The CUDA path on a machine with one NVIDIA GPU and a CUDA build of torch (docs/native_op.md, "Running the GPU
# check"): builds the native op with its CUDA kernel, checks it bitwise against the Python gather, trains the
# benchmark Llama with DeepCompile against eager ZeRO-3 and measures peak memory (scripts/gpu_check.py).
#   bash scripts/gpu_check.sh [gpu_check.py options]    # table on stdout, JSON and logs under out/gpu/
#   bash scripts/gpu_check.sh --fetch-wheels            # on a machine with PyPI: wheels for an offline GPU machine
# Set-up, unlike scripts/setup_env.sh, never pins torch: a venv under build/ that sees $PYTHON's packages uses
# the torch already there (a CUDA torch==2.13.0 from PyPI only if there is none); what else is missing comes from
# requirements/ without the torch pin, from PyPI or, offline, from the wheels in $WHEELS (default build/wheels/).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-build/wheels}
mkdir -p build
grep -h -v -E '^(-r|#|torch([=<>!~ ]|$))' requirements/requirements.txt requirements/requirements-dev.txt \
    >build/gpu_requirements.txt

if [ "${1:-}" = "--fetch-wheels" ]; then
    # DeepSpeed and those of its needs that the GPU image lacks, for its Python (GPU_PYTHON_VERSION, default 3.12)
    "$PYTHON" -m pip wheel -q --no-deps -w "$WHEELS" deepspeed==0.19.8
    "$PYTHON" -m pip download -q --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" \
        hjson pydantic  # with pydantic's own needs (pydantic-core in the version it pins)
    ls "$WHEELS"
    exit 0
fi

venv=${GPU_VENV:-build/gpu_venv}
if [ ! -x "$venv/bin/python" ]; then
    # a venv without packages of its own that sees $PYTHON's (its torch, its pip) after what is installed in it
    "$PYTHON" -m venv --without-pip "$venv"
    "$PYTHON" - >"$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")/_parent.pth" <<'PY'
import os, sys, sysconfig
std = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
std |= {os.path.join(p, "lib-dynload") for p in std}
print("\n".join(p for p in sys.path if p and os.path.isdir(p) and p not in std))
PY
fi
. "$venv/bin/activate"
python -m pip --version >/dev/null 2>&1 || python -m ensurepip >/dev/null
pip_args=(-q --disable-pip-version-check)
if [ -d "$WHEELS" ]; then pip_args+=(--no-index --find-links "$WHEELS"); fi
python -c "import torch" 2>/dev/null || python -m pip install "${pip_args[@]}" torch==2.13.0
DS_BUILD_OPS=0 python -m pip install "${pip_args[@]}" -r build/gpu_requirements.txt
# deepspeed.compile resolves to this checkout (benchmarks/checkout.py): nothing of the project is installed.
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU', torch.cuda.is_available())"
export TORCH_EXTENSIONS_DIR="$PWD/build/torch_extensions"
exec python scripts/gpu_check.py "$@"

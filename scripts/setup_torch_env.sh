#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A venv of its own for another supported torch release, with that torch pinned exactly, everything else as in .venv
# (requirements-dev.txt with the tested releases), and this package.
#     bash scripts/setup_torch_env.sh 2.14.1            # prints the venv's path on its last line
#     bash scripts/setup_torch_env.sh 2.15.0 --uncapped # a torch release above this machine's pip cap
# The venv is $DEEPSPEED_COMPILE_VENVS/venv-torch-VERSION (default ~/.cache/deepspeed-compile): a CUDA build of torch
# is gigabytes, so every clone of the repo shares one, reinstalled only when the requirements change (this package
# itself is installed again each time). torch 2.14.1 is a CUDA build (it lies on these machines' disk): the venv then
# also gets nvidia-cuda-crt, the CUDA headers that building the native op's CUDA path needs
# (scripts/build_native_cuda.py). --uncapped lifts the machine's pip constraint on torch for this venv's installs
# only (PIP_CONSTRAINT at an empty file).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: setup_torch_env.sh TORCH_VERSION [--uncapped]}"
venvs="${DEEPSPEED_COMPILE_VENVS:-$HOME/.cache/deepspeed-compile}"
venv="$venvs/venv-torch-$version"
mkdir -p "$venvs"
if [ "${2:-}" = "--uncapped" ]; then
    : > "$venvs/no-constraints.txt"
    export PIP_CONSTRAINT="$venvs/no-constraints.txt"
fi
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
. "$venv/bin/activate"
stamp="$venv/.installed"
# the inputs that decide what is installed: reinstall only when one of them changed
want="$(cat requirements/requirements.txt requirements/requirements-dev.txt requirements/constraints.txt \
        setup.py pyproject.toml | sha1sum | cut -c1-16) torch==$version"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    python -m pip install -q . --no-deps
    echo "$venv"
    exit 0
fi
rm -f "$stamp"
python -m pip install -q --upgrade pip setuptools wheel
python -m pip install -q "torch==$version"
# the tested releases of everything but torch (constraints.txt pins the CPU suite's torch)
grep -v '^torch' requirements/constraints.txt > "$venv/constraints.txt"
DS_BUILD_OPS=0 python -m pip install -q -r requirements/requirements-dev.txt -c "$venv/constraints.txt" \
    "torch==$version"
if python -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"; then
    cuda_major=$(python -c "import torch; print(torch.version.cuda.split('.')[0])")
    [ "$cuda_major" = 13 ] || { echo "setup_torch_env: no pinned CUDA headers for CUDA $cuda_major" >&2; exit 1; }
    python -m pip install -q nvidia-cuda-crt==13.0.88
fi
python -m pip install -q . --no-deps
DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$venv/torch_extensions" \
    python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
echo "$want" > "$stamp"
echo "$venv"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Create (or reuse) .venv in the repository and install everything the project needs, from the repo's own files.
# torch is pinned to the CPU build that lies on these machines; pip must never resolve an unpinned torch.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel
python -m pip install -q torch==2.13.0
DS_BUILD_OPS=0 python -m pip install -q -r requirements/requirements-dev.txt -c requirements/constraints.txt
python -m pip install -q . -c requirements/constraints.txt
# DeepSpeed's CPU communication backend JIT-builds a shared-memory op (deepspeed_shm_comm_op, about a minute of C++)
# the first time any process initializes deepspeed.comm. It is part of installing DeepSpeed here: build it now, into
# the extensions folder .ci/run and the main job set, rather than inside whichever test or training run comes first.
DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$PWD/build/torch_extensions" \
    python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Try deepspeed-compile on another DeepSpeed release: a venv of its own (build/try-deepspeed-VERSION) with the tested
# torch, that DeepSpeed release and the package, then the release checks and a few ZeRO-1/2/3 training tests against
# eager ZeRO, with the version refusal turned into a warning (DEEPSPEED_COMPILE_ALLOW_VERSIONS=1).
#     bash scripts/try_deepspeed.sh 0.19.7 [pytest arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: try_deepspeed.sh DEEPSPEED_VERSION [pytest arguments]}"
shift
venv="build/try-deepspeed-$version"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" || exit 1
fi
. "$venv/bin/activate"
python -m pip install -q --upgrade pip setuptools wheel || exit 1
python -m pip install -q torch==2.13.0 || exit 1
# the requirements with this DeepSpeed in place of the supported range, the tested releases of everything else
{ grep -hv -e '^deepspeed' -e '^-r' requirements/requirements.txt requirements/requirements-dev.txt
  echo "deepspeed==$version"; } > "$venv/requirements.txt"
grep -v '^deepspeed' requirements/constraints.txt > "$venv/constraints.txt"
DS_BUILD_OPS=0 python -m pip install -q -r "$venv/requirements.txt" -c "$venv/constraints.txt" || exit 1
python -m pip install -q . --no-deps || exit 1
python -c "import deepspeed; print('deepspeed', deepspeed.__version__)"
export DS_ACCELERATOR=cpu DEEPSPEED_COMPILE_ALLOW_VERSIONS=1 TORCH_EXTENSIONS_DIR="$PWD/$venv/torch_extensions"
python -c "from deepspeed.compile import compat
print('missing or changed, by ZeRO stage:', {stage: compat.target_problems(stage) for stage in (1, 2, 3)})"
python -m pytest -q -p no:cacheprovider tests/unit/compile/test_compat.py tests/unit/compile/test_foundation.py \
    tests/unit/compile/test_zero12.py -k "running_releases or trains or zero1_and_zero2 or bitwise" "$@"

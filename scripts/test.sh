#!/usr/bin/env bash
# Set up the environment and run the whole test suite (2-rank CPU tests included). Extra args go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
. .venv/bin/activate
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="$PWD/build/torch_extensions"
python -m pytest tests -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit "$rc"

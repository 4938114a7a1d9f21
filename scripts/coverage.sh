#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Which lines of deepspeed/compile the test suite never runs: the README's test command under coverage.py, with
# every process measured (pytest, the forkserver that starts the ranks, and each rank, which writes its data before
# it exits: tests/unit/compile/distributed.py). Not part of CI: it adds a few minutes to the suite. Extra arguments go
# to pytest (a test file, -k ...). Report with the missing lines: out/coverage/report.txt; HTML: out/coverage/html.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup_env.sh || exit 1
. .venv/bin/activate
python -c "import coverage" 2>/dev/null || python -m pip install -q -r requirements/requirements-dev.txt || exit 1
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="$PWD/build/torch_extensions"
out="$PWD/out/coverage"
rm -rf "$out"
mkdir -p "$out"
# parallel: one data file per process; multiprocessing: coverage starts in each forkserver child; the .pth file
# coverage installs starts it in every Python process that finds COVERAGE_PROCESS_START
cat > "$out/coveragerc" <<EOF
[run]
parallel = True
concurrency = multiprocessing,thread
source = $PWD/deepspeed/compile
data_file = $out/data
sigterm = True
EOF
COVERAGE_PROCESS_START="$out/coveragerc" python -m pytest tests -q -p no:cacheprovider "$@"
rc=$?
coverage combine --rcfile="$out/coveragerc" -q
coverage report --rcfile="$out/coveragerc" --show-missing --skip-covered > "$out/report.txt"
coverage html --rcfile="$out/coveragerc" -q -d "$out/html"
sed "s#$PWD/##" "$out/report.txt"
exit "$rc"

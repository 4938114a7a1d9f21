#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's main job: set up .venv, train a small Llama with DeepCompile (ZeRO-3) on 2 CPU ranks under the
# deepspeed launcher, then compare it side by side with eager ZeRO-3 (same model, data, seeds) and plot memory.
# Extra arguments go to benchmarks/main_job.py (e.g. --steps 20 --backend inductor).
set -euo pipefail
cd "$(dirname "$0")/.."
# MAIN_JOB_VENV: run in that venv as it is (scripts/try_torch.sh: another torch release) instead of .venv
if [ -n "${MAIN_JOB_VENV:-}" ]; then
    . "$MAIN_JOB_VENV/bin/activate"
else
    bash scripts/setup_env.sh
    . .venv/bin/activate
fi
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
export TORCHINDUCTOR_CACHE_DIR="$PWD/build/inductor_cache"
export OMP_NUM_THREADS=1
export PYTHONWARNINGS=ignore
mkdir -p out/main_job
log=out/main_job/train.log
# 1) The training run: the job's own lines are shown, everything (launcher, warnings) goes to the log.
set +e
deepspeed --num_accelerators 2 benchmarks/main_job.py "$@" 2>&1 | tee "$log" \
    | grep --line-buffered -E '^(main job:|step |done:|engine report:)'
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
    tail -n 40 "$log" >&2
    echo "main job: training run failed (exit $status), full log: $log" >&2
    exit "$status"
fi
echo "full training log: $log"
# 2) Side by side with eager ZeRO-3 on the same model: table, JSON and memory plots under out/bench/.
python benchmarks/run.py --model llama --rows zero3,ours-mincut --dtypes fp32 --backends eager --steps 5

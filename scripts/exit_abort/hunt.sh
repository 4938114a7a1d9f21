#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Launches a 2-rank CPU job N times, one launch at a time, and counts the launches in which a rank ended in
# std::terminate ("terminate called without an active exception", SIGABRT) or died of any other signal.
#     bash scripts/exit_abort/hunt.sh 20 torchrun --steps 3 --teardown process_group
#     bash scripts/exit_abort/hunt.sh 20 env --profile            # ranks started one process each, env:// rendezvous
# Launchers: torchrun (--standalone: the agent holds the store), env (two plain processes, rank 0 holds the
# TCPStore, as under the deepspeed launcher). Arguments after the launcher go to scripts/exit_abort/rank.py.
# Every rank runs with terminate_trace.cpp preloaded, so an abort's log holds the aborting thread's name and native
# backtrace; core dumps are on (where the kernel's core_pattern writes them is the machine's setting). The logs of
# every launch that failed are kept under build/exit_abort/.
set -uo pipefail
cd "$(dirname "$0")/../.."
launches="${1:?usage: hunt.sh LAUNCHES torchrun|env [rank.py arguments]}"
launcher="${2:?usage: hunt.sh LAUNCHES torchrun|env [rank.py arguments]}"
shift 2
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
out=build/exit_abort
mkdir -p "$out"
trace="$out/libterminate_trace.so"
g++ -shared -fPIC -O1 -g scripts/exit_abort/terminate_trace.cpp -o "$trace" || exit 1
trace="$PWD/$trace"
ulimit -c unlimited
aborted=0
failed=0
for i in $(seq 1 "$launches"); do
    log="$out/launch$i.log"
    port=$((29500 + RANDOM % 500))
    if [ "$launcher" = torchrun ]; then
        LD_PRELOAD="$trace" timeout 600 torchrun --standalone --nproc_per_node 2 scripts/exit_abort/rank.py "$@" \
            > "$log" 2>&1
        codes="$?"
    else
        pids=()
        for rank in 0 1; do
            LD_PRELOAD="$trace" MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=2 \
                LOCAL_WORLD_SIZE=2 timeout 600 python -u scripts/exit_abort/rank.py "$@" > "$log.rank$rank" 2>&1 &
            pids+=($!)
        done
        codes=""
        for pid in "${pids[@]}"; do wait "$pid"; codes="$codes$? "; done
        cat "$log.rank0" "$log.rank1" > "$log" && rm -f "$log.rank0" "$log.rank1"
    fi
    if grep -q "=== std::terminate" "$log"; then
        aborted=$((aborted + 1))
        echo "launch $i: std::terminate (exit codes $codes), log $log"
        grep -A 40 "=== std::terminate" "$log" | head -n 42
    elif [ "$(echo $codes | tr -d ' 0')" != "" ]; then
        failed=$((failed + 1))
        echo "launch $i: failed (exit codes $codes), log $log"
    else
        echo "launch $i: ok"
        rm -f "$log"
    fi
done
echo "exit_abort hunt: $aborted of $launches launches ended in std::terminate, $failed others failed" \
     "(launcher $launcher, rank.py $*)"

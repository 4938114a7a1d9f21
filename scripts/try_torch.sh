#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The tests on another torch release, in a venv of its own (scripts/setup_torch_env.sh: that torch pinned exactly,
# the tested releases of everything else). No version override is set: the release must pass compat.check as it is.
#     bash scripts/try_torch.sh 2.15.0 [pytest arguments]   # the whole suite (a torch above this machine's pip cap too)
#     bash scripts/try_torch.sh 2.14.1 --core               # the core cases and the main job, as .ci/run runs them
# On a CUDA build of torch (2.14.1 on these machines) the native op is built with its CUDA path first
# (scripts/build_native_cuda.py), and every test that loads the op loads that build.
set -uo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: try_torch.sh TORCH_VERSION [--core] [pytest arguments]}"
shift
core=0
if [ "${1:-}" = "--core" ]; then core=1; shift; fi
started=$(date +%s)
# the machine's pip cap on torch is lifted for this venv's installs (torch itself is pinned exactly)
venv=$(bash scripts/setup_torch_env.sh "$version" --uncapped | tail -n 1) || exit 1
. "$venv/bin/activate"
echo "try_torch: $(python -c 'import importlib.metadata as m, torch; print("torch", torch.__version__, "CUDA",
      torch.version.cuda, "deepspeed", m.version("deepspeed"))') in $venv ($(( $(date +%s) - started )) s to set up)"
export DS_ACCELERATOR=cpu CI="${CI:-true}" TORCH_EXTENSIONS_DIR="$venv/torch_extensions"
unset DEEPSPEED_COMPILE_ALLOW_VERSIONS
if python -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"; then
    python scripts/build_native_cuda.py || exit 1
    eval "$(python scripts/build_native_cuda.py --env)"
fi
if [ "$core" -eq 0 ]; then
    python -m pytest tests -q -p no:cacheprovider --durations=20 "$@"
    rc=$?
    echo "try_torch: torch $version, whole suite: exit $rc, $(( $(date +%s) - started )) s"
    exit "$rc"
fi
# The core cases: the release checks, the native op, ZeRO-3 fp32 on both transports and both backends, ZeRO-1/2 bit for
# bit (ZeRO-2's tied case on both transports), eager access, a dead peer; then the main job
t=tests/unit/compile
python -m pytest -q -p no:cacheprovider --durations=10 "$@" \
    $t/test_compat.py $t/test_native.py $t/test_cuda_build.py \
    "$t/test_pipeline.py::test_fp32_matches_eager_zero3[gpt-adamw-auto]" \
    "$t/test_pipeline.py::test_fp32_matches_eager_zero3[gpt-adamw-gloo]" \
    "$t/test_inductor.py::test_inductor_on_the_process_group_matches_eager_zero3" \
    "$t/test_inductor.py::test_inductor_matches_eager_zero3_and_saves_no_parameter" \
    "$t/test_zero12.py::test_fp32_matches_eager_zero_bitwise[zero1-tied]" \
    "$t/test_zero12.py::test_fp32_matches_eager_zero_bitwise[zero2-tied]" \
    "$t/test_eager_access.py::test_eagerly_run_code_reads_real_parameters" \
    "$t/test_faults.py::test_a_peer_that_exits_mid_training_makes_the_survivor_raise_within_seconds"
rc=$?
echo "try_torch: torch $version, core cases: exit $rc, $(( $(date +%s) - started )) s"
[ "$rc" -eq 0 ] || exit "$rc"
MAIN_JOB_VENV="$venv" bash scripts/main_job.sh --steps 6 || exit 1
echo "try_torch: torch $version, core cases and the main job passed, $(( $(date +%s) - started )) s"

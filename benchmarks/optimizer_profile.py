# SPDX-License-Identifier: Apache-2.0
"""Where a row's optimizer step goes: ``cProfile`` around ``engine.step()`` of one step after warm-up, rank 0.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/optimizer_profile.py \
        --row ours-mincut --model gpt2 --size 355m [--zero-settings defaults] [--steps 4] [--lines 30]

Builds the row as ``worker.py`` does (same model, config and batches), runs ``--steps`` steps printing each phase's
seconds (the optimizer's with the process's CPU time, page faults and context switches in it), and profiles the last
step's ``engine.step()``: the functions by cumulative time. One row per launch, so a
355M model fits in memory; run it for ``zero3`` too and compare.
"""
import argparse
import cProfile
import io
import os
import pstats
import resource
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import worker  # noqa: E402  (sets up the checkout's deepspeed.compile)
from benchmarks.models import make_batch, make_model, size_arg  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", default="ours-mincut", help="a DeepSpeed row of worker.py (zero3, ours-mincut, ...)")
    p.add_argument("--model", default="gpt2")
    p.add_argument("--size", type=size_arg, default="124m")
    p.add_argument("--zero-settings", default="defaults")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lines", type=int, default=30)
    args = p.parse_args()
    row_args = worker.parse_args(["--row", args.row, "--model", args.model, "--size", args.size,
                                  "--zero-settings", args.zero_settings])
    if args.row.startswith("fsdp2") or args.row == "local":
        p.error("--row: a DeepSpeed row (the optimizer step profiled is engine.step())")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    (forward, backward, optimizer_step), _ = worker.build_deepspeed(row_args, make_model(args.model, args.size, 0))
    profile = cProfile.Profile()
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = forward(make_batch(args.size, step, rank))
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        last = step == args.steps - 1
        if last:
            profile.enable()
        before, cpu = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        optimizer_step()
        after, cpu = resource.getrusage(resource.RUSAGE_SELF), time.process_time() - cpu
        if last:
            profile.disable()
        if rank == 0:
            print(f"step {step}: forward {t1 - t0:.2f} s, backward {t2 - t1:.2f} s, optimizer "
                  f"{time.perf_counter() - t2:.2f} s (CPU {cpu:.2f} s, page faults {after.ru_minflt - before.ru_minflt}"
                  f" minor {after.ru_majflt - before.ru_majflt} major, context switches "
                  f"{after.ru_nvcsw - before.ru_nvcsw} voluntary {after.ru_nivcsw - before.ru_nivcsw} involuntary)",
                  flush=True)
    if rank == 0:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.lines)
        print(out.getvalue())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

# SPDX-License-Identifier: Apache-2.0
"""Where a row's optimizer step goes: ``cProfile`` around ``engine.step()`` of one step after warm-up, rank 0.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/optimizer_profile.py \
        --row ours-mincut --model gpt2 --size 355m [--zero-settings defaults] [--steps 4] [--lines 30] [--values]

Builds the row as ``worker.py`` does (same model, config and batches), runs ``--steps`` steps printing each phase's
seconds (the optimizer's with the process's CPU time, page faults and context switches in it), and profiles the last
step's ``engine.step()``: the functions by cumulative time. One row per launch, so a
355M model fits in memory; run it for ``zero3`` too and compare. ``--values`` also prints, after the last step, what
the values the optimizer reads are: per kind of tensor (its parameters, their gradients, each state entry) the
elements, the subnormal ones (arithmetic on them takes a slow path on x86 unless the CPU flushes them), the
non-finite ones, and whether this process flushes subnormals to zero.
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


def print_values(optimizer: torch.optim.Optimizer) -> None:
    """Subnormal and non-finite elements of what ``optimizer`` (the torch optimizer inside ZeRO's) reads."""
    kinds = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            tensors = {"param": param, "grad": param.grad, **optimizer.state.get(param, {})}
            for kind, tensor in tensors.items():
                if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel() > 1:
                    flat = tensor.detach().reshape(-1)
                    subnormal = ((flat != 0) & (flat.abs() < torch.finfo(flat.dtype).tiny)).sum().item()
                    counts = kinds.setdefault(kind, [0, 0, 0])
                    counts[0] += flat.numel()
                    counts[1] += subnormal
                    counts[2] += (~torch.isfinite(flat)).sum().item()
    flushed = (torch.tensor([1e-39]) * 1.0).item() == 0
    print(f"subnormals flushed to zero in this process: {flushed}")
    for kind, (numel, subnormal, nonfinite) in kinds.items():
        print(f"{kind}: {numel} elements, {subnormal} subnormal, {nonfinite} not finite")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", default="ours-mincut", help="a DeepSpeed row of worker.py (zero3, ours-mincut, ...)")
    p.add_argument("--model", default="gpt2")
    p.add_argument("--size", type=size_arg, default="124m")
    p.add_argument("--zero-settings", default="defaults")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lines", type=int, default=30)
    p.add_argument("--values", action="store_true", help="after the steps, count subnormal and non-finite values in "
                   "what the optimizer reads")
    args = p.parse_args()
    row_args = worker.parse_args(["--row", args.row, "--model", args.model, "--size", args.size,
                                  "--zero-settings", args.zero_settings])
    if args.row.startswith("fsdp2") or args.row == "local":
        p.error("--row: a DeepSpeed row (the optimizer step profiled is engine.step())")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    (forward, backward, optimizer_step), engine = worker.build_deepspeed(row_args,
                                                                         make_model(args.model, args.size, 0))
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
    if rank == 0 and args.values:
        print_values(engine.optimizer.optimizer)
    if rank == 0:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.lines)
        print(out.getvalue())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One benchmark row's steady steps, in process: the median step and phases, or where backward's time goes.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/steady_step.py \
        --row ours-zero2 --model llama --size large --steps 8 [--section '{"partitioner": "default"}'] \
        [--aten-profile]

Builds the row as ``worker.py`` does (same model, config and batches), runs ``--warm`` untimed steps after the
compile step, then ``--steps`` timed steps with nothing else in the loop (no memory profiler, no collective
counting): rank 0 prints the median step and per-phase seconds. ``--section`` overrides keys of a DeepCompile row's
``"compile"`` section. ``--aten-profile`` instead runs each timed backward under ``torch.profiler`` and prints its
ops by self CPU time per step (what ``run.py``'s phase table cannot split). A tool for questions the driver's
numbers raise, not a second benchmark: ratios still come from ``run.py --rounds``.
"""
import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from benchmarks import worker  # noqa: E402  (selects this checkout's deepspeed.compile)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def build(args: argparse.Namespace, section: Dict) -> worker.Step:
    model = worker.make_model(args.model, args.size, args.seed)
    if args.row == "local":
        return worker.build_local(args, model)
    if args.row.startswith("fsdp2"):
        return worker.build_fsdp2(args, model)
    ds_config = worker.ds_config

    def with_section(*a, **k):
        config = ds_config(*a, **k)
        if section and "compile" not in config:
            raise ValueError(f"--section: row {args.row} has no 'compile' section to override")
        config.get("compile", {}).update(section)
        return config

    worker.ds_config = with_section
    try:
        return worker.build_deepspeed(args, model)[0]
    finally:
        worker.ds_config = ds_config


def backward_ops(fns: worker.Step, batches: List) -> List[Tuple[str, int, float]]:
    """(op, calls, self CPU seconds) summed over the backwards of ``batches``."""
    from torch.profiler import ProfilerActivity, profile
    forward, backward, step = fns
    totals: Dict[str, Tuple[int, float]] = {}
    for batch in batches:
        loss = forward(batch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            backward(loss)
        step()
        for e in prof.key_averages():
            calls, seconds = totals.get(e.key, (0, 0.0))
            totals[e.key] = (calls + e.count, seconds + e.self_cpu_time_total / 1e6)
    return sorted(((k, c, s) for k, (c, s) in totals.items()), key=lambda t: -t[2])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", choices=worker.ROWS, required=True)
    p.add_argument("--backend", choices=("eager", "inductor"), default="eager")
    p.add_argument("--dtype", choices=worker.DTYPES, default="fp32")
    p.add_argument("--model", default="llama")
    p.add_argument("--size", default="large")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warm", type=int, default=3, help="untimed steps after the compile step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--section", default="{}", help="JSON object merged into a DeepCompile row's compile section")
    p.add_argument("--aten-profile", action="store_true", help="backward's ops by self CPU time instead")
    worker.add_setting_args(p)
    args = p.parse_args()
    try:
        section = json.loads(args.section)
    except json.JSONDecodeError as err:
        p.error(f"--section: not JSON ({err})")
    if not isinstance(section, dict):
        p.error("--section: must be a JSON object")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    fns = build(args, section)
    batches = [worker.make_batch(args.size, i, rank) for i in range(1 + args.warm + args.steps)]
    for batch in batches[:1 + args.warm]:
        worker.train_step(fns, batch)
    timed = batches[1 + args.warm:]
    if args.aten_profile:
        ops = backward_ops(fns, timed)
        if rank == 0:
            total = sum(s for _, _, s in ops)
            print(f"{args.row}: backward self CPU {total / args.steps * 1e3:.1f} ms/step")
            for name, calls, seconds in ops[:25]:
                print(f"  {seconds / args.steps * 1e3:8.2f} ms  {calls // args.steps:5d}x  {name}")
    else:
        phases: Dict[str, List[float]] = {phase: [] for phase in worker.PHASES}
        steps = []
        for batch in timed:
            t0 = time.perf_counter()
            worker.train_step(fns, batch, phase_times=phases)
            steps.append(time.perf_counter() - t0)
        if rank == 0:
            parts = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in phases.items())
            print(f"{args.row} {json.dumps(section)}: step {statistics.median(steps):.3f} s ({parts})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

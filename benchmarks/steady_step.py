# SPDX-License-Identifier: Apache-2.0
"""Benchmark rows' steady steps, in one process: the median step and phases, or where backward's time goes.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/steady_step.py \
        --rows ours-zero2,zero2+compile --model llama --size large --steps 8 \
        [--section '{"partitioner": "default"}'] [--zero '[{}, {"reduce_bucket_size": 1e9}]'] \
        [--aten-profile [forward] [--by-shape] | --reduce-timeline] [--op-calls direct,overload]

Builds each row as ``worker.py`` does (same model, config and batches), runs ``--warm`` untimed steps after the
compile step, then ``--steps`` timed steps with nothing else in the loop (no memory profiler, no collective
counting): rank 0 prints each row's median step, per-phase seconds and the process's minor page faults per step, and
for a DeepCompile row what its engine report counted over the timed steps, per step: the time spent waiting on
collectives (the exposed all-gather wait, ZeRO-3 only, and the reduce wait) and the number of collectives. With
several rows each timed batch runs once per row, back to back, in the order given for even batches and reversed for
odd ones (so no row always runs after the same one, and a drift over the launch weighs on every row alike), and the
median of the first row's step over each other row's, per batch, is printed with a 95% interval (a bootstrap over
the batches; ours / baseline with the row under test first, below 1 better): the
rows share the machine's state from one moment to the next, so a ratio of a few percent can be seen here, where
separate launches differ by 10-25%. ``--op-calls`` (one value per row) compiles a row's eager-backend graphs calling
ATen ops through their ``OpOverload``, as FX writes them, instead of the C++ functions behind them (``direct``, what
DeepCompile does: ``driver/eager_code.direct_op_calls``): the same configuration twice shows what that costs.
``--section`` overrides keys of a DeepCompile row's ``"compile"`` section, ``--zero`` keys of a DeepSpeed row's
``"zero_optimization"`` section: a JSON object for every row, or a list of them, one per row. ``--aten-profile``
instead runs each timed backward (``--aten-profile forward``: forward) under ``torch.profiler`` and prints its ops
by self CPU time per step (what ``run.py``'s phase table cannot split; ``--by-shape``: each op split by the shapes of
its inputs). ``--reduce-timeline`` instead prints, for
ZeRO-1/2 rows and every rank, when ZeRO's bucket reductions start in backward and how long each takes (both ranks
start each backward together): what is compute and what is the reductions. A tool for questions the driver's
numbers raise, not a second benchmark: the benchmark's ratios still come from ``run.py --rounds``.
"""
import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from benchmarks import worker  # noqa: E402  (selects this checkout's deepspeed.compile)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.compile.report import engine_report  # noqa: E402


def build(args: argparse.Namespace, row: str, section: Dict, zero: Dict) -> Tuple[worker.Step, Optional[object]]:
    """The row's step functions, and its DeepSpeed engine (None for the rows without one)."""
    args = argparse.Namespace(**{**vars(args), "row": row})
    model = worker.make_model(args.model, args.size, args.seed, labels=args.labels)
    if (section or zero) and (row == "local" or row.startswith("fsdp2")):
        raise ValueError(f"--section/--zero: row {row} has no DeepSpeed config to override")
    if row == "local":
        return worker.build_local(args, model), None
    if row.startswith("fsdp2"):
        return worker.build_fsdp2(args, model), None
    ds_config = worker.ds_config

    def with_section(*a, **k):
        config = ds_config(*a, **k)
        if section and "compile" not in config:
            raise ValueError(f"--section: row {row} has no 'compile' section to override")
        config.get("compile", {}).update(section)
        config["zero_optimization"].update(zero)
        return config

    worker.ds_config = with_section
    try:
        return worker.build_deepspeed(args, model)
    finally:
        worker.ds_config = ds_config


def phase_ops(fns: worker.Step, batches: List, phase: str, by_shape: bool = False) -> List[Tuple[str, int, float]]:
    """(op, calls, self CPU seconds) summed over the ``phase`` (forward or backward) of each of ``batches``; with
    ``by_shape`` an op is split by the shapes of its inputs (``op [shapes]``)."""
    from torch.profiler import ProfilerActivity, profile
    forward, backward, step = fns
    totals: Dict[str, Tuple[int, float]] = {}

    def profiled(name: str):
        return (profile(activities=[ProfilerActivity.CPU], record_shapes=by_shape) if name == phase
                else contextlib.nullcontext())

    for batch in batches:
        with profiled("forward") as fwd:
            loss = forward(batch)
        with profiled("backward") as bwd:
            backward(loss)
        step()
        for e in (fwd if phase == "forward" else bwd).key_averages(group_by_input_shape=by_shape):
            key = f"{e.key} {e.input_shapes}" if by_shape else e.key
            calls, seconds = totals.get(key, (0, 0.0))
            totals[key] = (calls + e.count, seconds + e.self_cpu_time_total / 1e6)
    return sorted(((k, c, s) for k, (c, s) in totals.items()), key=lambda t: -t[2])


def reduction_timeline(fns: worker.Step, engine, batches: List) -> Tuple[List[float], List[List[Tuple[float, float]]]]:
    """ZeRO-1/2 rows: each step's backward seconds, and each of ZeRO's bucket reductions in it (its
    ``reduce_ipg_grads``, wherever it is called from: a gradient hook, DeepCompile's runtime, the end of backward) as
    (seconds from the start of backward, seconds it took). Both ranks start each backward together."""
    optimizer = engine.optimizer
    own = vars(optimizer).get("reduce_ipg_grads")  # DeepCompile's runtime counts them through an instance attribute
    reduce_ipg_grads = optimizer.reduce_ipg_grads
    spans: List[Tuple[float, float]] = []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return reduce_ipg_grads(*args, **kwargs)
        finally:
            spans.append((start, time.perf_counter() - start))

    forward, backward, step = fns
    backwards, steps = [], []
    optimizer.reduce_ipg_grads = timed
    try:
        for batch in batches:
            loss = forward(batch)
            spans.clear()
            dist.barrier()
            t0 = time.perf_counter()
            backward(loss)
            backwards.append(time.perf_counter() - t0)
            steps.append([(start - t0, took) for start, took in spans])
            step()
    finally:
        if own is None:
            del optimizer.reduce_ipg_grads
        else:
            optimizer.reduce_ipg_grads = own
    return backwards, steps


def summarize_timeline(steps: List[List[Tuple[float, float]]]) -> Tuple[List[Tuple[float, float]], float]:
    """Per bucket reduction, by its position in the step: the medians over the steps of its start and of its
    duration; and the median over the steps of the time spent in reductions (steps with a different number of
    reductions than the first are left out of the positions, not of the total)."""
    count = len(steps[0])
    same = [spans for spans in steps if len(spans) == count]
    positions = [(statistics.median(s[i][0] for s in same), statistics.median(s[i][1] for s in same))
                 for i in range(count)]
    return positions, statistics.median(sum(took for _, took in spans) for spans in steps)


@contextlib.contextmanager
def graph_op_calls(calls: str):
    """``overload``: eager-backend graphs compiled inside call ATen ops as FX writes them
    (``torch.ops.aten.mm.default(...)``); ``direct``: as DeepCompile calls them."""
    from deepspeed.compile.driver import eager_code
    direct = eager_code.direct_op_calls
    if calls == "overload":
        eager_code.direct_op_calls = lambda source, gm, namespace: source
    try:
        yield
    finally:
        eager_code.direct_op_calls = direct


def paired_ratio(first: List[float], other: List[float]) -> str:
    """The first row's step over another row's, per batch (ours / baseline with the row under test first: below 1,
    the first row's step is shorter): the median of the per-batch ratios and its 95% interval."""
    ratios = [a / b for a, b in zip(first, other)]
    low, high = median_interval(ratios)
    return f"; the first row's step over this row's, per batch: median {statistics.median(ratios):.3f}x " \
        f"(95% {low:.3f}-{high:.3f})"


def median_interval(values: List[float], resamples: int = 2000, seed: int = 0) -> Tuple[float, float]:
    """A 95% interval for the median of ``values``: the 2.5th and 97.5th percentiles of the medians of ``resamples``
    resamples with replacement (a percentile bootstrap; seeded, so a launch's figures can be recomputed)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def per_row(parser: argparse.ArgumentParser, flag: str, text: str, rows: List[str]) -> List[Dict]:
    """A flag's JSON: one object for every row, or a list of objects, one per row."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        parser.error(f"{flag}: not JSON ({err})")
    values = value if isinstance(value, list) else [value] * len(rows)
    if len(values) != len(rows) or not all(isinstance(v, dict) for v in values):
        parser.error(f"{flag}: must be a JSON object, or a list of {len(rows)} objects (one per row of --rows)")
    return values


def comm_summary(before: Optional[Dict], after: Optional[Dict], steps: int) -> str:
    """A DeepCompile row's collectives per timed step, from its engine reports before and after the ``steps``: the
    time waited on them (exposed all-gather wait for ZeRO-3, reduce wait) and how many, and the forward graphs it
    compiled (a graph break makes more); empty for other rows."""
    if before is None or after is None:
        return ""

    def per_step(key: str) -> float:
        return (after.get(key, 0) - before.get(key, 0)) / steps

    gathers = ""
    if "gather_seconds" in after:
        gathers = (f"all-gather wait {per_step('gather_seconds') * 1e3:.1f} ms "
                   f"({per_step('allgather_collectives'):.0f} collectives), ")
    fused = ""
    if "matmul_grads" in after:  # ZeRO-1/2
        fused = (f", {per_step('matmul_grads'):.0f} weight gradients computed by their reduce "
                 f"({per_step('grads_in_bucket'):.0f} in ZeRO's bucket)")
    return (f"; per step: {gathers}reduce wait {per_step('reduce_wait_seconds') * 1e3:.1f} ms "
            f"({per_step('reduce_collectives'):.0f} collectives){fused}; forward graphs compiled: "
            f"{after.get('graphs_compiled', 0)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", "--row", required=True, help=f"comma-separated, of {', '.join(worker.ROWS)}")
    p.add_argument("--backend", choices=("eager", "inductor"), default="eager")
    p.add_argument("--dtype", choices=worker.DTYPES, default="fp32")
    p.add_argument("--model", default="llama")
    p.add_argument("--size", default="large")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warm", type=int, default=3, help="untimed steps after the compile step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--labels", action="store_true", help="a transformers model computes its own loss from labels, as "
                   "Hugging Face's Trainer has it do (default: the loss is computed on its logits)")
    p.add_argument("--section", default="{}", help="JSON object (or list, one per row) merged into a DeepCompile "
                   "row's compile section")
    p.add_argument("--op-calls", default=None, help="comma-separated, one per row: direct (default) or overload, how "
                   "a DeepCompile row's eager-backend graph code calls ATen ops")
    p.add_argument("--zero", default="{}", help="JSON object (or list, one per row) merged into a DeepSpeed row's "
                   "zero_optimization section")
    instead = p.add_mutually_exclusive_group()
    instead.add_argument("--aten-profile", nargs="?", const="backward", choices=("forward", "backward"),
                         help="the ops of backward (or of the phase named) by self CPU time instead")
    p.add_argument("--by-shape", action="store_true", help="with --aten-profile: each op split by its inputs' shapes")
    instead.add_argument("--reduce-timeline", action="store_true", help="ZeRO-1/2 rows: when ZeRO's bucket reductions run "
                   "in backward and how long each takes, on every rank, instead")
    worker.add_setting_args(p)
    args = p.parse_args()
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in worker.ROWS]
    if unknown:
        p.error(f"--rows: unknown {unknown}; choose from {', '.join(worker.ROWS)}")
    sections, zeros = (per_row(p, flag, text, rows) for flag, text in (("--section", args.section),
                                                                        ("--zero", args.zero)))
    op_calls = args.op_calls.split(",") if args.op_calls else ["direct"] * len(rows)
    if len(op_calls) != len(rows) or set(op_calls) - {"direct", "overload"}:
        p.error(f"--op-calls: one of direct/overload per row of --rows ({len(rows)}), got {args.op_calls!r}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    labels = [f"{row} {json.dumps(sec)} {json.dumps(zero)}{' (ATen ops through OpOverload)' * (calls == 'overload')}"
              for row, sec, zero, calls in zip(rows, sections, zeros, op_calls)]
    built = [build(args, row, sec, zero) for row, sec, zero in zip(rows, sections, zeros)]
    batches = [worker.make_batch(args.size, i, rank) for i in range(1 + args.warm + args.steps)]
    engines = [engine for _, engine in built]
    built = [fns for fns, _ in built]
    if args.reduce_timeline:
        no_buckets = [row for row, e in zip(rows, engines) if not hasattr(getattr(e, "optimizer", None), "ipg_buckets")]
        if no_buckets:
            p.error(f"--reduce-timeline: rows {no_buckets} have no ZeRO-1/2 reduce buckets")
    for fns, calls in zip(built, op_calls):
        with graph_op_calls(calls):  # the row's graphs compile in its first step (backward's in its first backward)
            for batch in batches[:1 + args.warm]:
                worker.train_step(fns, batch)
    timed = batches[1 + args.warm:]
    if args.reduce_timeline:
        for label, fns, engine in zip(labels, built, engines):
            backwards, steps = reduction_timeline(fns, engine, timed)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (statistics.median(backwards), summarize_timeline(steps)))
            if rank == 0:
                print(f"{label}: bucket reductions in backward (median start + median duration, ms)")
                for r, (backward, (positions, total)) in enumerate(everyone):
                    spans = " ".join(f"{start * 1e3:.0f}+{took * 1e3:.0f}" for start, took in positions)
                    print(f"  rank {r}: backward {backward * 1e3:.0f} ms; {spans}; in reductions {total * 1e3:.0f} "
                          "ms/step")
    elif args.aten_profile:
        for label, fns in zip(labels, built):
            ops = phase_ops(fns, timed, args.aten_profile, args.by_shape)
            if rank == 0:
                total = sum(s for _, _, s in ops)
                print(f"{label}: {args.aten_profile} self CPU {total / args.steps * 1e3:.1f} ms/step")
                for name, calls, seconds in ops[:25]:
                    print(f"  {seconds / args.steps * 1e3:8.2f} ms  {calls // args.steps:5d}x  {name}")
    else:
        phases = [{phase: [] for phase in worker.PHASES} for _ in rows]
        steps: List[List[float]] = [[] for _ in rows]
        faults: List[List[int]] = [[] for _ in rows]
        before = [engine_report(e) if e is not None else None for e in engines]
        for i, batch in enumerate(timed):
            for r in (range(len(rows)) if i % 2 == 0 else reversed(range(len(rows)))):
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                worker.train_step(built[r], batch, phase_times=phases[r])
                steps[r].append(time.perf_counter() - t0)
                faults[r].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        after = [engine_report(e) if e is not None else None for e in engines]
        if rank == 0:
            for r, label in enumerate(labels):
                parts = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in phases[r].items())
                ratio = ""
                if r:
                    ratio = paired_ratio(steps[0], steps[r])
                comm = comm_summary(before[r], after[r], len(timed))
                print(f"{label}: step {statistics.median(steps[r]):.3f} s ({parts}){ratio}; "
                      f"page faults {statistics.median(faults[r]):.0f}/step{comm}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

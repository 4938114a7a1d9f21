# SPDX-License-Identifier: Apache-2.0
"""Side-by-side benchmark: eager ZeRO-3, ZeRO-3 + torch.compile, DeepCompile (ours, two partitioners), FSDP2.

    python benchmarks/run.py                                  # default matrix, small GPT, 2 CPU ranks
    python benchmarks/run.py --model llama --rows zero3,ours-mincut --dtypes fp32 --backends eager,inductor
    python benchmarks/run.py --model llama --size large --rows zero3,ours-mincut,local --dtypes fp32 --rounds 3

Each configuration runs in a fresh 2-rank launch (``torch.distributed.run --standalone``) on the same model,
data and seeds (``benchmarks/worker.py``). Prints a Markdown table, writes ``results_<model>.json`` and the
memory plots under ``--out`` (default ``out/bench``). Final losses of one dtype are checked against eager
ZeRO-3 of that dtype (or the first row if it was not run); a mismatch is reported as FAILED and makes the exit
status non-zero, as does a crash of any configuration but the stock baseline ``zero3+compile`` (plain
torch.compile of a ZeRO-3 model, which stock DeepSpeed 0.19.8 cannot trace for models that call F.linear on a
tied weight: its crash is shown in the table as ERROR and does not fail the run).

Step times on a shared machine drift by 10-25% between launches. ``--rounds N`` runs the whole matrix N times,
interleaved (round k starts k configurations further on, so none always runs first or after the same one): a
configuration's step time is then the median of its N per-launch medians, and each ratio under the table is given
per round as well (rounds are paired: the configurations of one round ran minutes apart).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from benchmarks import compile_profile  # noqa: E402
from benchmarks.models import MODELS, SIZES, size_arg  # noqa: E402
from benchmarks.plots import config_name, file_stem, plot_all  # noqa: E402
from benchmarks.worker import DTYPES, EAGER_ROWS, ROWS, add_setting_args, setting_argv  # noqa: E402

# Final-loss agreement within one dtype, relative to the reference row. fp32: the math is the same, compiled
# kernels only reorder reductions, so differences stay at fp32 round-off amplified by a few Adam steps.
# bf16 / autocast: 8-bit mantissas (relative rounding 2^-8 = 0.4%), and fused kernels keep fp32 intermediates
# where eager rounds each op to bf16; FSDP2 also keeps fp32 master weights where DeepSpeed's bf16 starts
# from bf16-rounded ones.
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "autocast": 2e-2}
NO_BACKEND = EAGER_ROWS
MiB = float(1 << 20)


def matrix(rows: List[str], dtypes: List[str], backends: List[str]) -> List[Tuple[str, str, str]]:
    out = []
    for dtype in dtypes:
        for row in rows:
            for backend in (["-"] if row in NO_BACKEND else backends):
                out.append((row, backend, dtype))
    return out


def run_config(args: argparse.Namespace, row: str, backend: str, dtype: str, round_index: int = 0) -> Dict[str, Any]:
    """Launch one configuration on ``--nproc`` ranks; the result dict, or an error record."""
    stem = file_stem({"model": args.model, "dtype": dtype, "row": row, "backend": backend})
    if args.rounds > 1:
        stem += f"-round{round_index + 1}"
    out_json = os.path.join(args.out, "runs", f"{stem}.json")
    log_path = os.path.join(args.out, "runs", f"{stem}.log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           os.path.join(REPO_ROOT, "benchmarks", "worker.py"), "--row", row, "--dtype", dtype,
           "--backend", "eager" if backend == "-" else backend, "--model", args.model, "--size", args.size,
           "--steps", str(args.steps), "--warmup", str(args.warmup), *setting_argv(args),
           "--out", out_json]
    if args.progress:
        cmd.append("--progress")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO_ROOT, "build", "torch_extensions"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(REPO_ROOT, "build", "inductor_cache"))
    if args.cold_compile:
        # every configuration compiles from nothing: first-step times compare compilers, not cache hits
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    if os.path.exists(out_json):
        os.remove(out_json)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE if args.progress else log, stderr=log,
                                  text=True, timeout=args.timeout, env=env)
            rc = proc.returncode
            if args.progress and proc.stdout:
                print(proc.stdout, end="", flush=True)
                log.write(proc.stdout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    if rc == 0 and os.path.exists(out_json):
        with open(out_json) as f:
            result = json.load(f)
        result["wall_s"] = wall
        return result
    with open(log_path) as f:
        tail = f.read()[-2000:]
    return {"row": row, "backend": backend, "dtype": dtype, "model": args.model, "size": args.size,
            "error": f"exit {rc}, log {log_path}", "log_tail": tail, "wall_s": wall}


def check_losses(results: List[Dict[str, Any]]) -> None:
    """Set ``loss_check`` on every result: ok / FAILED against the dtype's reference row (n/a for ``local``, whose
    ranks never average their gradients)."""
    for dtype in DTYPES:
        group = [r for r in results if r["dtype"] == dtype and "error" not in r]
        checked = [r for r in group if r["row"] != "local"]
        for r in group:
            r["step_vs_zero3"] = _step_vs_zero3(r, group)
            if r["row"] == "local":
                r["loss_check"] = "n/a"
        if not checked:
            continue
        ref = next((r for r in checked if r["row"] == "zero3"), checked[0])
        for r in checked:  # every launch of a configuration (each round's) against the reference's first
            losses = r.get("round_final_losses", [r["final_loss"]])
            rel = max(abs(loss - ref["final_loss"]) for loss in losses) / max(abs(ref["final_loss"]), 1e-12)
            r["loss_rel_diff"] = rel
            r["loss_ref"] = config_name(ref)
            r["loss_check"] = "ok" if rel <= LOSS_RTOL[dtype] else "FAILED"


def _step_vs_zero3(r: Dict[str, Any], group: List[Dict[str, Any]]) -> Optional[float]:
    """This row's median step over eager ZeRO-3's of the same dtype: below 1 is a shorter step (ours / baseline, the
    direction of every ratio the benchmarks print)."""
    base = [x for x in group if x["row"] == "zero3"]
    return r["median_step_s"] / base[0]["median_step_s"] if base else None


# each DeepCompile row against the rows it must beat (min-cut against the default partitioner too), what keeping
# parameters gathered for backward buys (ours-mincut over ours-regather), and the compute floor against the eager
# baselines: (row, baseline)
BASELINES = (("ours-mincut", "zero3"), ("ours-mincut", "fsdp2"), ("ours-mincut", "ours-default"),
             ("ours-regather", "zero3"), ("ours-mincut", "ours-regather"), ("ours-mincut", "ours-mincut-heap"),
             ("ours-zero1", "zero1"),
             ("ours-zero2", "zero2"), ("ours-zero2", "zero2+compile"), ("ours-zero2-default", "zero2"),
             ("ours-zero2-default", "ours-zero2"), ("local", "zero3"), ("local", "zero2"))


def ratios(results: List[Dict[str, Any]]) -> str:
    """Median step (and peak above the step start) of each DeepCompile row over its baselines', per dtype and backend
    (same run): ours / baseline, below 1 better."""
    lines = []
    for r in results:
        for row, base in BASELINES:
            if r["row"] != row or "error" in r:
                continue
            for b in results:
                same = b["dtype"] == r["dtype"] and b["backend"] in ("-", r["backend"])
                if b["row"] == base and same and "error" not in b:
                    peak = ("n/a" if not r["peak_above_start_bytes"] or not b["peak_above_start_bytes"]
                            else f"{r['peak_above_start_bytes'] / b['peak_above_start_bytes']:.2f}x")
                    lines.append(f"- {r['dtype']}, {config_name(r)} / {config_name(b)}: step "
                                 f"{r['median_step_s'] / b['median_step_s']:.2f}x{_per_round(r, b)}, "
                                 f"peak above start {peak}")
    return "\n".join(lines)


def _per_round(r: Dict[str, Any], b: Dict[str, Any]) -> str:
    """The step ratio of each round (paired launches), with several rounds."""
    mine, theirs = r.get("round_medians_s", []), b.get("round_medians_s", [])
    if len(mine) < 2 or len(mine) != len(theirs):
        return ""
    per = [m / t for m, t in zip(mine, theirs)]
    return f" (rounds: {', '.join(f'{x:.2f}' for x in per)}; median of rounds {statistics.median(per):.2f}x)"


def merge_rounds(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One configuration's launches, one per round, as one result: the first round's record (memory and counts, the
    same every launch), its step time the median of the rounds' medians, every round's final loss (each is checked,
    ``check_losses``). A failed round makes it an error."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    merged = dict(runs[0])
    if len(runs) > 1:
        merged["round_medians_s"] = [r["median_step_s"] for r in runs]
        merged["median_step_s"] = statistics.median(merged["round_medians_s"])
        merged["round_final_losses"] = [r["final_loss"] for r in runs]
        for key in ("phase_medians_s", "wait_per_step_s"):
            if all(key in r for r in runs):
                merged[key] = {part: statistics.median(r[key][part] for r in runs) for part in runs[0][key]}
    return merged


def phase_table(results: List[Dict[str, Any]]) -> str:
    """Where each configuration's step goes: rank 0's median forward, backward and optimizer seconds, and for
    DeepCompile rows the seconds per step spent waiting on gathers and on gradient reductions (inside those phases)."""
    rows = [r for r in results if "error" not in r and "phase_medians_s" in r]
    if not rows:
        return ""
    lines = ["| dtype | configuration | step (s) | forward (s) | backward (s) | optimizer (s) | gather wait (s) | "
             "reduce wait (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, w = r["phase_medians_s"], r.get("wait_per_step_s")
        waits = f"{w['gather']:.3f} | {w['reduce']:.3f}" if w else "- | -"
        lines.append(f"| {r['dtype']} | {config_name(r)} | {r['median_step_s']:.3f} | {p['forward']:.3f} | "
                     f"{p['backward']:.3f} | {p['optimizer']:.3f} | {waits} |")
    return "\n".join(lines)


def _mib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / MiB:.2f}"


def table(results: List[Dict[str, Any]]) -> str:
    head = ("| dtype | configuration | median step (s) | step / zero3 step | first step (s) | peak above start "
            "(MiB) | peak abs (MiB) | saved param (MiB) | saved other (MiB) | all-gather (MiB/step) | "
            "reduce-scatter (MiB/step) | kept gathered (MiB) | peak RSS a rank (MiB) | final loss | loss check |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['dtype']} | {config_name(r)} | ERROR: {r['error']} |" + " |" * 12)  # 15 columns
            continue
        speed = "n/a" if r.get("step_vs_zero3") is None else f"{r['step_vs_zero3']:.2f}x"
        saved_mark = "" if r.get("saved_source") == "engine_report" else "*"
        comm_mark = "" if r.get("comm_source") == "engine_report" else "†"
        check = r.get("loss_check", "n/a")
        if check == "FAILED":
            check = f"**FAILED** ({r['loss_rel_diff']:.1e} vs {r['loss_ref']})"
        elif check == "ok":
            check = f"ok ({r.get('loss_rel_diff', 0):.0e})"
        lines.append(
            f"| {r['dtype']} | {config_name(r)} | {r['median_step_s']:.3f} | {speed} | {r['first_step_s']:.2f} | "
            f"{_mib(r['peak_above_start_bytes'])} | {_mib(r['peak_bytes'])} | "
            f"{_mib(r['saved_param_bytes'])}{saved_mark} | {_mib(r['saved_other_bytes'])}{saved_mark} | "
            f"{_mib(r['allgather_bytes_per_step'])}{comm_mark} | {_mib(r['reduce_scatter_bytes_per_step'])}"
            f"{comm_mark} | {_mib((r.get('report') or {}).get('kept_gathered_bytes'))} | "
            f"{_mib(r.get('peak_rss_bytes'))} | {r['final_loss']:.5f} | {check} |")
    lines.append("")
    lines.append("\\* from the autograd graph (param-derived is a lower bound for compiled graphs); † counted at "
                 "torch.distributed; unmarked: the DeepCompile engine's own report. Loss tolerance (relative): "
                 + ", ".join(f"{k} {v:g}" for k, v in LOSS_RTOL.items()) + ".")
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated subset of fp32,bf16,autocast")
    p.add_argument("--backends", default="eager", help="compile backends for compiled rows: eager,inductor")
    p.add_argument("--model", default="gpt", choices=sorted(MODELS))
    p.add_argument("--size", default="small", type=size_arg,
                   help=f"{', '.join(SIZES)}, or NAME:LAYERS (that size with another number of blocks)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole matrix this many times, interleaved; step time = median of the rounds' medians")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (compile) step")
    p.add_argument("--nproc", type=int, default=2, help="ranks per configuration")
    add_setting_args(p)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "out", "bench"))
    p.add_argument("--progress", action="store_true", help="show each step of each configuration")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--compile-profile", action="store_true",
                   help="also print where each configuration's first step went (dynamo, AOTAutograd, our passes, "
                        "inductor phases, C++ compile): benchmarks/compile_profile.py")
    p.add_argument("--live-at-peak", action="store_true",
                   help="also print, per configuration, what was live at its peak above the step start, by what "
                        "allocated it (benchmarks/memory.py: live_at_peak)")
    p.add_argument("--cold-compile", action="store_true",
                   help="a fresh, empty inductor cache for every configuration (fair first-step compile times)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds: must be at least 1, got {args.rounds}")
    for name, allowed in (("rows", ROWS), ("dtypes", DTYPES), ("backends", ("eager", "inductor"))):
        values = [v for v in getattr(args, name).split(",") if v]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            p.error(f"--{name}: {bad or 'empty'} not in {','.join(allowed)}")
        setattr(args, name, values)
    return args


def live_table(results: List[Dict[str, Any]]) -> str:
    """One section per configuration: what was live at its peak, by what allocated it, largest first."""
    parts = []
    for r in results:
        if not r.get("live_at_peak"):
            continue
        name = r["row"] if r["backend"] == "-" else f"{r['row']}[{r['backend']}]"
        lines = [f"{r['dtype']} {name}: peak above start {_mib(r['peak_above_start_bytes'])} MiB", "",
                 "| allocated by | MiB | blocks |", "|---|---|---|"]
        lines += [f"| `{label}` | {_mib(size)} | {count} |" for label, size, count in r["live_at_peak"]]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    configs = matrix(args.rows, args.dtypes, args.backends)
    t0 = time.perf_counter()
    runs: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {config: [] for config in configs}
    done, total = 0, len(configs) * args.rounds
    for k in range(args.rounds):
        shift = k % len(configs)
        for row, backend, dtype in configs[shift:] + configs[:shift]:
            done += 1
            where = f"round {k + 1}, " if args.rounds > 1 else ""
            print(f"[{done}/{total}] {where}{dtype} {row}{'' if backend == '-' else f'[{backend}]'} ...",
                  end="" if not args.progress else "\n", flush=True)
            r = run_config(args, row, backend, dtype, k)
            runs[(row, backend, dtype)].append(r)
            status = r["error"] if "error" in r else f"median {r['median_step_s']:.3f} s, loss {r['final_loss']:.5f}"
            print(f" {status} ({r['wall_s']:.0f} s wall)", flush=True)
    results = [merge_rounds(runs[config]) for config in configs]
    check_losses(results)
    print()
    rounds = f", median of {args.rounds} interleaved rounds" if args.rounds > 1 else ""
    print(f"## {args.model} ({args.size}), {args.nproc} CPU ranks, {args.steps} timed steps{rounds}\n")
    print(table(results))
    if phase_table(results):
        print(f"\nWhere the step goes (median seconds per phase; waits per step, inside the phases):\n\n"
              f"{phase_table(results)}")
    if ratios(results):
        print(f"\nRatios (median step, peak above step start):\n{ratios(results)}")
    if args.compile_profile:
        print(f"\n### First step, by compile phase (rank 0, exclusive seconds)\n\n{compile_profile.table(results)}")
    if args.live_at_peak:
        print(f"\n### Live at the peak, by what allocated it (rank 0, MiB allocated in the step)\n\n{live_table(results)}")
    json_path = os.path.join(args.out, f"results_{args.model}.json")
    with open(json_path, "w") as f:
        json.dump({"args": vars(args), "loss_rtol": LOSS_RTOL, "results": results}, f, indent=1)
    print(f"\nJSON: {json_path}")
    if not args.no_plots:
        ok = [r for r in results if "error" not in r]
        for path in plot_all(ok, args.out):
            print(f"plot: {path}")
    print(f"total wall time {time.perf_counter() - t0:.0f} s")
    failed = [r for r in results
              if ("error" in r and r.get("row") not in ("zero3+compile", "zero2+compile")) or r.get("loss_check") == "FAILED"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

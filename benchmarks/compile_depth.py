# SPDX-License-Identifier: Apache-2.0
"""Compile time against depth: the first step of the same model with 2, 6, 12 and 24 of its blocks, split by compile
phase (``benchmarks/compile_profile.py``), whole model against block by block, on each backend.

    python benchmarks/compile_depth.py --model gpt2 --size 124m --depths 2,6,12,24 \
        --rows ours-mincut,ours-blocks --backends eager,inductor

Each depth is one ``run.py`` matrix (a fresh 2-rank launch per configuration, one timed step after the first, fp32)
on ``SIZE:DEPTH``; inductor compiles with a cold cache of its own per launch (``run.py --cold-compile``), so every
row pays its whole compile. Prints one Markdown table, a row per configuration and depth, a column per phase, and
writes ``compile_depth_<model>.json`` under ``--out``.
"""
import argparse
import json
import os
import sys
from typing import Any, Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from benchmarks import compile_profile, run  # noqa: E402
from benchmarks.plots import config_name  # noqa: E402

SHOWN = ("dynamo", "AOTAutograd", "partition", "our passes", "inductor lowering",
         "inductor codegen + C++ compile + load", "running step 0")


def measure(args: argparse.Namespace, depth: int) -> List[Dict[str, Any]]:
    out = os.path.join(args.out, f"depth{depth}")
    argv = ["--model", args.model, "--size", f"{args.size}:{depth}", "--rows", args.rows, "--backends", args.backends,
            "--dtypes", "fp32", "--steps", "1", "--warmup", "0", "--zero-settings", args.zero_settings,
            "--compile-profile", "--cold-compile", "--no-plots", "--out", out]
    path = os.path.join(out, f"results_{args.model}.json")
    if not (args.resume and os.path.exists(path)):
        run.main(argv)
    with open(path) as f:
        results = json.load(f)["results"]
    return [dict(r, depth=depth) for r in results if "error" not in r and r.get("compile_timers")]


def table(results: List[Dict[str, Any]]) -> str:
    head = ("| configuration | blocks | first step (s) | " + " | ".join(f"{p} (s)" for p in SHOWN)
            + " | frames dynamo compiled | graphs inductor compiled |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in sorted(results, key=lambda r: (config_name(r), r["depth"])):
        split = compile_profile.phases(r["compile_timers"], r.get("report") or {}, r["first_step_s"])
        timers = r["compile_timers"]
        lines.append(f"| {config_name(r)} | {r['depth']} | {r['first_step_s']:.1f} | "
                     + " | ".join(f"{split[p]:.1f}" for p in SHOWN)
                     + f" | {timers.get('calls:' + compile_profile._FRAME, 0):.0f}"
                     f" | {timers.get('calls:' + compile_profile._INDUCTOR, 0):.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2")
    p.add_argument("--size", default="124m")
    p.add_argument("--depths", default="2,6,12,24")
    p.add_argument("--rows", default="ours-mincut,ours-blocks")
    p.add_argument("--backends", default="eager,inductor")
    p.add_argument("--zero-settings", default="defaults")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "out", "compile_depth"))
    p.add_argument("--resume", action="store_true", help="take a depth's results from --out where they are")
    args = p.parse_args()
    results = [r for depth in (int(d) for d in args.depths.split(",")) for r in measure(args, depth)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"compile_depth_{args.model}.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n## Compile time against depth: {args.model} ({args.size} blocks), 2 CPU ranks, rank 0\n")
    print(table(results))


if __name__ == "__main__":
    main()

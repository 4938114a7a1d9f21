# SPDX-License-Identifier: Apache-2.0
"""Time ``fast_free_schedule`` on the forward and backward graphs of a 48-block GPT (target: under 2 s each).

The graphs are the benchmark GPT's (``benchmarks/models.py``) as the pipeline hands them to the scheduler, built
without a process group: AOTAutograd with the capture stage's recompute tags and the min-cut partitioner, a gather
per parameter after the placeholders (in traced order), then the pipeline's rewrite passes (reduces in backward,
releases after the last readers). Capturing takes a while; only the scheduler is timed. Also prints the static
memory plan's peaks: traced, scheduled, and the lower bound.

    python benchmarks/bench_schedule.py [--blocks 48] [--repeat 3]
"""
import argparse
import os
import statistics
import sys
import time
from typing import Dict, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.checkout import use_checkout  # noqa: E402

use_checkout()  # this checkout's deepspeed.compile, before deepspeed is imported

import torch  # noqa: E402
from torch._functorch.aot_autograd import aot_function, make_boxed_func  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402
from torch.func import functional_call  # noqa: E402
from torch.fx import GraphModule  # noqa: E402

from benchmarks.models import GPT, ModelSize  # noqa: E402
from deepspeed.compile.graph import rewrite  # noqa: E402
from deepspeed.compile.graph.nodes import META_DS_ID, placeholders  # noqa: E402
from deepspeed.compile.graph.recompute import tag_param_aliases_pass  # noqa: E402
from deepspeed.compile.runtime.ops import GATHER  # noqa: E402
from deepspeed.compile.schedule import (fast_free_schedule, gathered_lower_bound, largest_gathered_bytes,  # noqa: E402
                                        peak_gathered_bytes)

LIMIT_S = 2.0
# The graphs are scheduled, never run: their ops name no runtime (the registry's ids start at 1).
NO_RUNTIME = 0


def _insert_gathers(gm: GraphModule, num_params: int) -> None:
    """A gather of each parameter input (``primals_<ds_id + 1>``) after the last placeholder, in traced order."""
    graph = gm.graph
    inputs = {n.target: n for n in placeholders(graph)}
    anchor = placeholders(graph)[-1]
    for ds_id in range(num_params):
        primal = inputs.get(f"primals_{ds_id + 1}")
        if primal is None:  # not an input of this graph
            continue
        with graph.inserting_after(anchor):
            gather = graph.call_function(GATHER, (primal, NO_RUNTIME, ds_id, None, [], 0))
        gather.meta["val"] = primal.meta["val"]
        primal.replace_all_uses_with(gather, delete_user_cb=lambda user: user is not gather and user.op != "output")
        anchor = gather


def capture_gpt(layers: int, dim: int, heads: int, vocab: int = 61, seq: int = 8) -> Tuple[GraphModule, GraphModule]:
    """The forward and backward graphs of a GPT, with its ZeRO-3 ops placed as the pipeline places them before
    scheduling."""
    torch.manual_seed(0)
    model = GPT(ModelSize(vocab=vocab, dim=dim, heads=heads, layers=layers, seq=seq, batch=2))
    names = [name for name, _ in model.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, vocab, (2, seq), generator=generator) for _ in range(2)]
    graphs: Dict[str, GraphModule] = {}

    def partition(joint, joint_inputs, **kwargs):
        for ds_id, primal in enumerate(placeholders(joint.graph)[:len(params)]):
            primal.meta[META_DS_ID] = ds_id
        tag_param_aliases_pass(joint)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def keep(name):

        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm)

        return compiler

    def run(*args):
        return functional_call(model, dict(zip(names, args[:len(params)])), args[len(params):])

    aot_function(run, keep("fw"), keep("bw"), partition_fn=partition)(*params, *inputs).backward()
    fw, bw = graphs["fw"], graphs["bw"]
    _insert_gathers(fw, len(params))
    _insert_gathers(bw, len(params))
    rewrite.insert_reduces_pass(bw, runtime_id=NO_RUNTIME, grad_ds_ids=list(range(len(params))))
    for gm in (fw, bw):
        rewrite.insert_releases_pass(gm, runtime_id=NO_RUNTIME)
        gm.graph.lint()
        gm.recompile()
    return fw, bw


def clone(gm: GraphModule) -> GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return GraphModule(gm, graph)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prefetch", type=int, default=1)
    args = parser.parse_args()

    start = time.perf_counter()
    captured = dict(zip(("fw", "bw"), capture_gpt(layers=args.blocks, dim=16, heads=2)))
    print(f"captured {args.blocks}-block GPT in {time.perf_counter() - start:.1f} s")
    slowest = 0.0
    for which, traced in captured.items():
        bound = gathered_lower_bound(traced)
        for order in ("traced", "first_use"):
            times = []
            for _ in range(args.repeat):
                copy = clone(traced)
                start = time.perf_counter()
                scheduled = fast_free_schedule(copy, prefetch=args.prefetch, collective_order=order)
                times.append(time.perf_counter() - start)
            slowest = max(slowest, statistics.median(times))
            print(f"{which} {len(traced.graph.nodes):5d} nodes, collective_order={order:9s} "
                  f"prefetch={args.prefetch}: median {statistics.median(times):.3f} s, max {max(times):.3f} s | "
                  f"gathered peak traced {peak_gathered_bytes(traced)} B, "
                  f"scheduled {peak_gathered_bytes(scheduled)} B, lower bound {bound.gathered_bytes} B "
                  f"(largest param {largest_gathered_bytes(traced)} B)")
    # The median, not the max: this machine is shared, and one run can lose a core to another process.
    verdict = "ok" if slowest < LIMIT_S else "TOO SLOW"
    print(f"slowest median schedule {slowest:.3f} s (limit {LIMIT_S} s): {verdict}")
    return 0 if slowest < LIMIT_S else 1


if __name__ == "__main__":
    sys.exit(main())

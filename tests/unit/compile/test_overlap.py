# SPDX-License-Identifier: Apache-2.0
"""Coalesced, prefetched gathers: the static memory plan counts the collectives in flight, and the runtime's measured
peak of live gathered bytes (which counts their receive buffers too) stays at or below it; parameters kept gathered
from forward to backward within ``compile.keep_gathered_bytes`` are not gathered again in backward."""
from types import SimpleNamespace
from typing import Dict, List

import pytest
import torch
from torch.fx import Graph, GraphModule

from deepspeed.compile.runtime.ops import GATHER, RELEASE, encode_plan
from deepspeed.compile.schedule import memory_plan, peak_gathered_bytes
from distributed import run_distributed

FP32 = 4


def _runs_graph(runs: List[List[int]], sizes: Dict[int, int], coalesced: bool) -> GraphModule:
    """Gather each run's parameters back to back, read each (a sum), release them, then the next run. With
    ``coalesced`` the first gather of each run carries its plan, as ``coalesce_gathers_pass`` leaves it."""
    graph = Graph()
    standins = {}
    for ds_id, numel in sizes.items():
        standins[ds_id] = graph.placeholder(f"p{ds_id}")
        standins[ds_id].meta["val"] = torch.empty(1).expand(numel)  # 4 bytes of storage, full shape
    outputs = []
    for k, run in enumerate(runs):
        gathered = []
        for j, ds_id in enumerate(run):
            following = runs[k + 1] if k + 1 < len(runs) else []
            plan = encode_plan([(i, None) for i in run], [(i, None) for i in following]) if coalesced and j == 0 else ""
            node = graph.call_function(GATHER, (standins[ds_id], 0, ds_id, None, [], plan))
            node.meta["val"] = torch.empty(sizes[ds_id])
            gathered.append(node)
        for node in gathered:
            total = graph.call_function(torch.ops.aten.sum.default, (node, ))
            total.meta["val"] = torch.empty(())
            graph.call_function(RELEASE, (node, 0, node.args[2], [total]))
            outputs.append(total)
    graph.output(tuple(outputs))
    return GraphModule(torch.nn.Module(), graph)


def _gathered_at_gathers(gm: GraphModule) -> Dict[int, int]:
    """ds_id -> live gathered bytes the plan counts while that parameter's gather runs."""
    records = memory_plan(gm)
    return {node.args[2]: records[i].gathered for i, node in enumerate(gm.graph.nodes) if node.target is GATHER}


def test_memory_plan_counts_the_run_in_flight():
    sizes = {1: 10, 2: 20, 3: 30, 4: 40}
    runs = [[1, 2], [3, 4]]
    at = _gathered_at_gathers(_runs_graph(runs, sizes, coalesced=True))
    run1, run2 = (10 + 20) * FP32, (30 + 40) * FP32
    # at run 1's first gather: its parameters, its own receive buffer, and run 2's collective started ahead
    assert at[1] == run1 + run1 + run2
    # at run 2's first gather: its parameters and the receive buffer they are copied out of
    assert at[3] == run2 + run2
    assert peak_gathered_bytes(_runs_graph(runs, sizes, coalesced=True)) == 2 * run2
    # not coalesced: each parameter is gathered by its own op, straight into its buffer, nothing ahead
    assert peak_gathered_bytes(_runs_graph(runs, sizes, coalesced=False)) == run2
    # a lone first parameter has no receive buffer of its own
    assert _gathered_at_gathers(_runs_graph([[1], [3, 4]], sizes, coalesced=True))[1] == 10 * FP32 + run2


# ----- rank functions (module level: each rank imports them by name) ---------------------------------------
def _rank_gather_runs(through_shm: bool) -> Dict:
    """Two runs of made-up sharded parameters (one in flight ahead), gathered by ``GatherRuns`` in chunks, in fp32
    and cast to bf16, through gloo or through shared memory with fewer slots than chunks: what it hands over, the
    live gathered bytes it recorded on the way, and how many collectives went through shared memory."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.compile.runtime import z3_runs
    from deepspeed.compile.runtime.comm import CommLog
    from deepspeed.compile.runtime.host_comm import HostComm
    from deepspeed.compile.runtime.ops import encode_plan

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    widths = [700, 300, 1000, 50, 600]  # shard elements; the last shard of each parameter padded, as ZeRO-3 pads

    def shard(ds_id: int, of_rank: int) -> torch.Tensor:
        return torch.arange(widths[ds_id], dtype=torch.float32) / 7 + 1000 * ds_id + 100 * of_rank

    params = {}
    for ds_id, width in enumerate(widths):
        param = torch.nn.Parameter(torch.empty(0))
        param.ds_id, param.ds_numel, param.ds_shape = ds_id, width * world - 3, (width * world - 3, )
        param.ds_tensor = shard(ds_id, rank)
        params[ds_id] = param
    first = [(0, None), (1, torch.bfloat16), (2, None), (3, torch.bfloat16)]  # two dtypes: two collectives
    second = [(4, torch.bfloat16), (0, torch.bfloat16)]
    z3_runs.GATHER_CHUNK_NUMEL = 1200  # several chunks a run
    comm = CommLog(timeout_s=60)
    # slots of 500 fp32 elements: a chunk (600 of a rank's elements, or a 700- or 1000-element shard alone) spans two
    host = HostComm(None, 4 * 500, 64, gather_slots=2) if through_shm else None
    got = {}

    def add(param, dtype, flat, refs, shard):
        got[(param.ds_id, dtype)] = flat.clone()
        comm.add_live_bytes(flat.numel() * flat.element_size(), eager=False)  # as the runtime counts it

    # the runs' parts, as the runtime's (ShardedParams, Transport, GatheredBuffers) present themselves to them
    table = SimpleNamespace(params=params, names={i: f"p{i}" for i in params}, offloaded=False,
                            name=lambda p: f"p{p.ds_id}")
    transport = SimpleNamespace(group=None, world_size=world, device=torch.device("cpu"), host=host,
                                native_start=False)
    runs = z3_runs.GatherRuns(table, transport, comm, SimpleNamespace(add=add), is_gathered=lambda key: key in got,
                              prefetch_across_graphs=False)
    runs.run(encode_plan(first, second), 0, params[0])  # gathers the first run, starts the second
    started_ahead = runs.has_inflight
    runs.finish_inflight()
    out = {"got": got, "live": comm.counters.gather.live_gathered_bytes, "started_ahead": started_ahead,
           "collectives": comm.counters.gather.allgather_collectives,
           "through_shm": 0 if host is None else host.gather._next, "paths": comm.counters.gather.allgather_collectives_by_path}
    out["expected"] = {(ds_id, dtype or torch.float32): torch.cat([shard(ds_id, r) for r in range(world)]).to(dtype or torch.float32)
                       for ds_id, dtype in first + second}
    return out


def _rank_coalesced(layers: int, backend: str, prefetch_numel: int, steps: int, keep=None) -> Dict:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.compile.engine_state import runtime_of
    from deepspeed.compile.report import engine_report
    from models import TinyGPT, ds_config, make_batch

    deepspeed.init_distributed(dist_backend="gloo")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(layers=layers)
    config = ds_config(3, {"deepcompile": True, **({} if keep is None else {"keep_gathered_bytes": keep})})
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = prefetch_numel
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    engine.compile(backend=backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        loss = engine(*make_batch("gpt", step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report = engine_report(engine)
    runtime = runtime_of(engine)
    # every gathered buffer is padded to whole shards; a receive buffer and the copies out of it carry it twice
    padding = 2 * sum((p.ds_tensor.numel() * world_size - p.ds_numel) * p.ds_tensor.element_size()
                      for p in runtime.sharded.values())
    out = {key: report[key] for key in ("gathers", "allgather_collectives", "peak_gathered_bytes",
                                        "planned_peak_gathered_bytes", "live_gathered_bytes", "saved_param_bytes",
                                        "runs_started_ahead", "unclaimed_gathers")}
    out.update(losses=losses, padding=padding, active=engine.is_deepcompile_active(),
               largest=max(p.ds_numel * p.ds_tensor.element_size() for p in runtime.sharded.values()))
    engine.destroy()
    return out


@pytest.mark.parametrize("through_shm", [False, True], ids=["gloo", "shm"])
def test_a_runs_collective_hands_over_each_parameter_gathered(through_shm):
    """A run's collective, received as rows and copied out chunk by chunk: every parameter bitwise what the ranks'
    shards concatenate to, in its gather dtype, and the live gathered bytes back to what was handed over. (Not gloo's
    coalesced form, received into each parameter's own buffer: it corrupts the heap beside another collective in
    flight, ``benchmarks/gloo_collectives.py --race``.)"""
    for r in run_distributed(_rank_gather_runs, through_shm, timeout_s=120):
        expected = r["expected"]
        assert r["started_ahead"]
        assert set(r["got"]) == set(expected)
        for key, tensor in expected.items():
            assert r["got"][key].dtype == tensor.dtype and torch.equal(r["got"][key], tensor), key
        assert r["live"] == sum(t.numel() * t.element_size() for t in expected.values())
        assert r["collectives"] > 3  # several chunks, and a collective per dtype of a run
        # through shared memory every collective went through the slots, some of them two slots' worth
        assert (r["through_shm"] > r["collectives"]) if through_shm else r["through_shm"] == 0, r
        assert r["paths"] == {"shm" if through_shm else "python": r["collectives"]}, r["paths"]


def test_in_flight_bound_holds_on_the_12_block_gpt():
    """Coalesced gathers with one run in flight ahead: the runtime's measured peak (receive buffers included) stays
    within the static plan's, which is not vacuous (at most twice the measured peak)."""
    for r in run_distributed(_rank_coalesced, 12, "eager", 20000, 3, timeout_s=400):
        assert r["active"] and r["live_gathered_bytes"] == 0
        assert r["allgather_collectives"] < r["gathers"] / 3, r  # coalesced
        assert r["runs_started_ahead"] > 0, r  # prefetched: the bound is checked with runs in flight
        assert r["unclaimed_gathers"] == 0, r  # everything prefetched was used
        assert r["peak_gathered_bytes"] <= r["planned_peak_gathered_bytes"] + r["padding"], r
        assert r["planned_peak_gathered_bytes"] <= 2 * r["peak_gathered_bytes"], r
        assert r["peak_gathered_bytes"] > 20000 * FP32 // 2, r  # runs are gathered whole, more than one parameter
        assert r["peak_gathered_bytes"] > r["largest"], r  # more than the largest parameter alone


def _rank_kept(budget: int) -> Dict:
    from compare import run_pair
    r = run_pair("gpt", 3, compile_section={"keep_gathered_bytes": budget}, grad_steps=1)
    return {"compared": r, "gathers": r["counters"]["gathers"], "saved": r["saved"]}


def test_parameters_kept_gathered_are_not_gathered_again_in_backward():
    """``keep_gathered_bytes``: the last parameters gathered in forward stay gathered for backward (saved, within the
    budget), so backward gathers fewer; the arithmetic is the same (fp32, eager backend: bitwise equal to eager
    ZeRO-3)."""
    from compare import assert_bitwise_equal
    budget = 40_000
    base = run_distributed(_rank_kept, 0)
    kept = run_distributed(_rank_kept, budget)
    for b, k in zip(base, kept):
        assert_bitwise_equal(k["compared"])
        assert b["saved"]["param_bytes"] == 0
        assert 0 < k["saved"]["param_bytes"] <= budget, k["saved"]
        assert k["gathers"] < b["gathers"], (k["gathers"], b["gathers"])


def _rank_keep_prefetch(prefetch: int) -> Dict:
    from compare import run_compiled, run_pair
    overrides = {"stage3_prefetch_bucket_size": prefetch}
    kept = run_pair("gpt", 2, compile_section={"keep_gathered_bytes": "prefetch"}, grad_steps=None,
                    zero_overrides=overrides)
    base = run_compiled("gpt", 2, compile_section={"keep_gathered_bytes": 0}, zero_overrides=overrides)
    return {"kept": kept, "base": {"saved": base["saved"], "gathers": base["counters"]["gathers"]}}


def test_keep_one_prefetch_bucket():
    """``keep_gathered_bytes: "prefetch"``: one prefetch bucket (of fp32 here) stays gathered for backward, against
    keeping none (``0``; the default would keep what eager ZeRO-3's prefetcher keeps); the arithmetic is eager
    ZeRO-3's (fp32, eager backend: every loss, the gradients after every backward and the parameters bitwise equal to
    eager ZeRO-3 trained in the same ranks)."""
    from compare import assert_bitwise_equal, assert_ran_compiled
    prefetch = 5000
    for r in run_distributed(_rank_keep_prefetch, prefetch, timeout_s=300):
        k, b = r["kept"], r["base"]
        assert_ran_compiled(k)
        assert_bitwise_equal(k)
        assert len(k["grads"]) == 2, len(k["grads"])
        assert b["saved"]["param_bytes"] == 0, b
        assert 0 < k["saved"]["param_bytes"] <= prefetch * FP32, k["saved"]
        assert k["counters"]["gathers"] < b["gathers"], (k["counters"]["gathers"], b["gathers"])

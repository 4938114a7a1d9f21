# SPDX-License-Identifier: Apache-2.0
"""The fast-free scheduler and the static memory plan, on traced GPT graphs: no process group needed.

Forward and backward graphs come from ``graphs.make_gpt``: AOTAutograd with the min-cut partitioner, the ZeRO-3
ops placed in traced order, a fake runtime that makes them executable on CPU.
"""
import logging
import operator
from typing import Dict, List

import pytest
import torch
from torch.fx import GraphModule, Node

from deepspeed.compile.runtime.ops import GATHER, REDUCE, RELEASE
from deepspeed.compile.schedule import (compute_fast_free_order, fast_free_schedule, gathered_lower_bound,
                                        largest_gathered_bytes, memory_plan, peak_gathered_bytes)
from deepspeed.compile.schedule.fast_free import find_lazy_nodes
from graphs import Captured, FakeRuntime, clone, make_gpt, trace

logger = logging.getLogger(__name__)
aten = torch.ops.aten


def _is_alias(node: Node) -> bool:
    """The release checks' own notion of an alias, kept apart from ``graph.nodes.alias_source`` (which the
    scheduler places releases by) on purpose: any op whose schema declares an aliasing return, and the
    ``getitem`` after it, whichever input it aliases. An alias the package's code missed would then fail here
    rather than be missed by the scheduler and its test alike."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], Node) and _is_alias(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(ret.alias_info is not None for ret in schema.returns)


@pytest.fixture(scope="module")
def models() -> Dict[str, Captured]:
    return {"gpt": make_gpt(layers=2, dim=16, heads=2), "deep": make_gpt(layers=12, dim=16, heads=2)}


def collectives(gm: GraphModule) -> List[tuple]:
    return [(str(n.target), n.args[2]) for n in gm.graph.nodes if n.target in (GATHER, REDUCE)]


def signature(gm: GraphModule) -> List[tuple]:
    return [(n.op, str(n.target), n.name) for n in gm.graph.nodes]


@pytest.mark.parametrize("model", ["gpt", "deep"])
@pytest.mark.parametrize("which", ["fw", "bw"])
@pytest.mark.parametrize("order", ["traced", "first_use"])
def test_peak_not_above_traced_and_near_lower_bound(models, model, which, order):
    traced = getattr(models[model], which)
    scheduled = fast_free_schedule(clone(traced), prefetch=0, collective_order=order)
    before, after = peak_gathered_bytes(traced), peak_gathered_bytes(scheduled)
    bound, unit = gathered_lower_bound(traced), largest_gathered_bytes(traced)
    logger.info("%s %s %s: traced %d, scheduled %d, lower bound %d (unit %d)", model, which, order, before, after,
                bound.gathered_bytes, unit)
    assert bound.gathered_bytes <= after <= before
    if which == "fw" or order == "first_use":
        # Backward gathers are traced in forward order; only "first_use" may reorder them to meet the bound.
        assert after <= bound.gathered_bytes + unit
    if model == "deep" and (which == "fw" or order == "first_use"):
        assert after * 3 < before


@pytest.mark.parametrize("which", ["fw", "bw"])
@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_prefetch_stays_within_depth_and_traced_peak(models, which, prefetch):
    traced = getattr(models["deep"], which)
    scheduled = fast_free_schedule(clone(traced), prefetch=prefetch, collective_order="first_use")
    assert peak_gathered_bytes(scheduled) <= peak_gathered_bytes(traced)
    assert peak_gathered_bytes(scheduled) >= peak_gathered_bytes(
        fast_free_schedule(clone(traced), prefetch=0, collective_order="first_use"))
    nodes = list(scheduled.graph.nodes)
    lazy = set(find_lazy_nodes(nodes))
    issued: Dict[Node, None] = {}
    unread: Dict[Node, None] = {}
    most_ahead = 0
    for node in nodes:
        if node.target is GATHER:
            issued[node] = unread[node] = None
        for source in node.all_input_nodes:
            unread.pop(source, None)
        if node not in lazy and node.target is not RELEASE:
            assert len(unread) <= prefetch, f"{len(unread)} gathers ahead at {node.name}"
            most_ahead = max(most_ahead, len(unread))
    # and it did prefetch: some computation ran while a gather was in flight (with prefetch=0 none does)
    assert most_ahead >= 1, most_ahead


@pytest.mark.parametrize("model, order", [("gpt", "traced"), ("gpt", "first_use"), ("deep", "first_use")])
def test_same_values_and_collective_order(models, model, order):
    captured = models[model]
    for which, args in (("fw", captured.fw_args), ("bw", captured.bw_args)):
        traced = getattr(captured, which)
        scheduled = fast_free_schedule(clone(traced), prefetch=1, collective_order=order)
        captured.runtime.calls.clear()
        with torch.no_grad():
            expected = traced(*args)
            traced_log = captured.runtime.ops()
            captured.runtime.calls.clear()
            got = scheduled(*args)
        assert len(expected) == len(got)
        for want, have in zip(expected, got):
            assert (want is None and have is None) or torch.equal(want, have)
        log = captured.runtime.ops()
        assert sorted(e for e in log if e[0] == "release") == sorted(e for e in traced_log if e[0] == "release")
        reduces = [e for e in log if e[0] == "reduce"]
        assert reduces == [e for e in traced_log if e[0] == "reduce"]
        if order == "traced":
            assert collectives(scheduled) == collectives(traced)
            assert [e for e in log if e[0] != "release"] == [e for e in traced_log if e[0] != "release"]
        else:
            assert sorted(e for e in log if e[0] == "gather") == sorted(e for e in traced_log if e[0] == "gather")


def test_release_follows_every_alias_use(models):
    for which in ("fw", "bw"):
        scheduled = fast_free_schedule(clone(getattr(models["gpt"], which)), collective_order="first_use")
        position = {n: i for i, n in enumerate(scheduled.graph.nodes)}
        releases = [n for n in scheduled.graph.nodes if n.target is RELEASE]
        assert releases, f"the {which} graph releases nothing: nothing below is checked"
        for release in releases:
            gathered, members, readers = release.args[0], [release.args[0]], []
            for member in members:
                for user in member.users:
                    readers.append(user)
                    if _is_alias(user):
                        members.append(user)
            assert all(position[r] <= position[release] for r in readers)
            # Released right after its last reader, modulo other releases and reduces that became ready too, and
            # the getitem of a multi-output reader the release waits on (a no-op node).
            last = max(position[r] for r in readers if r is not release)
            between = list(scheduled.graph.nodes)[last + 1:position[release]]
            assert all(n.target in (RELEASE, REDUCE, operator.getitem) for n in between), (gathered.name, between)


def test_deterministic(models):
    for which in ("fw", "bw"):
        for order in ("traced", "first_use"):
            traced = getattr(models["gpt"], which)
            first = fast_free_schedule(clone(traced), collective_order=order)
            second = fast_free_schedule(clone(traced), collective_order=order)
            assert signature(first) == signature(second)
            # A second pass finds nothing left to improve and keeps the order.
            assert signature(fast_free_schedule(clone(first), collective_order=order)) == signature(first)
    # Two separately traced copies of the same model schedule to the same sequence.
    one, two = models["gpt"], make_gpt(layers=2, dim=16, heads=2)
    for which in ("fw", "bw"):
        a = fast_free_schedule(clone(getattr(one, which)), collective_order="first_use")
        b = fast_free_schedule(getattr(two, which), collective_order="first_use")
        assert signature(a) == signature(b)
        assert [n.args[2:] for n in a.graph.nodes if n.target is GATHER] == \
            [n.args[2:] for n in b.graph.nodes if n.target is GATHER]


def _small_graph() -> GraphModule:
    runtime = FakeRuntime([torch.randn(64, 64)])

    def step(standin, x):
        w = GATHER(standin, runtime.id, 0, None, [], "")
        y = x @ w.t()  # the view must not count twice
        z = torch.relu(y) @ w  # w is needed again after relu
        RELEASE(w, runtime.id, 0, [y, z])
        return z.sum(0)

    gm = trace(step, (64, 64), (8, 64))
    gm.runtime = runtime  # keep the weakly registered runtime alive as long as the graph
    return gm


def test_memory_plan_counts_views_once():
    gm = _small_graph()
    plan = memory_plan(gm)
    weight, act = 64 * 64 * 4, 8 * 64 * 4
    by_name = {r.name: r for r in plan}
    assert max(r.gathered for r in plan) == weight
    assert all(r.inputs == weight + act for r in plan)
    gather = next(n for n in gm.graph.nodes if n.target is GATHER)
    release = next(n for n in gm.graph.nodes if n.target is RELEASE)
    assert by_name[gather.name].gathered == weight and by_name[release.name].gathered == weight
    after = list(gm.graph.nodes).index(release) + 1
    assert all(r.gathered == 0 for r in plan[after:])
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    assert by_name[relu.name].activation == 2 * act  # y and relu(y); t(w) is a view of w
    bound = gathered_lower_bound(gm)
    assert bound.gathered_bytes == weight and bound.node is not None
    # Of the nodes that need the weight, the second matmul holds the most: relu(y) and its result.
    assert bound.activation_bytes == 2 * act


def test_graph_without_ops_is_untouched():
    gm = trace(lambda a, b: (a @ b).relu() + a, (4, 4), (4, 4))
    before = signature(gm)
    assert compute_fast_free_order(gm.graph) == list(gm.graph.nodes)
    assert signature(fast_free_schedule(gm)) == before


@pytest.mark.parametrize("knobs", [{"prefetch": -1}, {"prefetch": 1.5}, {"collective_order": "random"}])
def test_bad_knobs_are_named(knobs):
    with pytest.raises(ValueError, match=next(iter(knobs))):
        fast_free_schedule(_small_graph(), **knobs)

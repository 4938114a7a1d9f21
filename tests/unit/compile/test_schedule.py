"""The fast-free scheduler and the static memory plan, on traced GPT graphs: no process group needed.

Forward and backward graphs come from AOTAutograd with the min-cut partitioner (parameter views tagged for
recompute, as the capture stage does). ``insert_zero3_ops`` then places the graph ops the way the rewrite pass
does in traced order: every gather right after the placeholders, each release after the last real use (seeing
through views), a reduce after each parameter gradient. A fake runtime makes the ops executable on CPU.
"""
import logging
import operator
from typing import Dict, List, NamedTuple, Optional

import pytest
import torch
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.func import functional_call
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from deepspeed.compile.runtime import registry
from deepspeed.compile.graph.rewrite import insert_releases_pass
from deepspeed.compile.runtime.ops import GATHER, REDUCE, RELEASE
from deepspeed.compile.schedule import (compute_fast_free_order, fast_free_schedule, gathered_lower_bound,
                                        largest_gathered_bytes, memory_plan, peak_gathered_bytes)
from deepspeed.compile.schedule.fast_free import find_lazy_nodes
from models import TinyGPT

logger = logging.getLogger(__name__)
aten = torch.ops.aten
# What the capture stage tags for recompute: views of parameters (enough for these models).
PARAM_VIEWS = {aten.t.default, aten.view.default, aten.slice.Tensor, aten.transpose.int, aten.permute.default,
               aten.expand.default}


class FakeRuntime:
    """Stands in for the ZeRO-3 runtime: gathers return the stored full tensor, everything is logged."""

    def __init__(self, params: List[torch.Tensor]):
        self.params = params
        self.log: List[tuple] = []

    def gather(self, ds_id: int, dtype: Optional[torch.dtype], plan=0) -> torch.Tensor:
        self.log.append(("gather", ds_id))
        return self.params[ds_id].detach().to(dtype or self.params[ds_id].dtype, copy=True)

    def release(self, ds_id: int, gathered: torch.Tensor) -> None:
        self.log.append(("release", ds_id))

    def reduce(self, ds_id: int, grad: torch.Tensor) -> None:
        self.log.append(("reduce", ds_id))


class Captured(NamedTuple):
    fw: GraphModule
    bw: GraphModule
    fw_args: list
    bw_args: list
    runtime: FakeRuntime


def _is_alias(node: Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], Node) and _is_alias(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(ret.alias_info is not None for ret in schema.returns)


def insert_zero3_ops(gm: GraphModule, runtime_id: int, num_params: int, backward: bool) -> GraphModule:
    """Place gather/release (and in backward reduce) ops as the rewrite pass does, in traced order."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    param_ids = {f"primals_{i + 1}": i for i in range(num_params)}
    anchor, gathers = placeholders[-1], []
    for ph in placeholders:
        if ph.target not in param_ids:
            continue
        with graph.inserting_after(anchor):
            gather = graph.call_function(GATHER, (ph, runtime_id, param_ids[ph.target], None, [], 0))
        gather.meta["val"] = ph.meta["val"]
        ph.replace_all_uses_with(gather, delete_user_cb=lambda user, g=gather: user is not g and user.op != "output")
        anchor = gather
        gathers.append(gather)
    insert_releases_pass(gm, runtime_id=runtime_id)  # the pipeline's own release placement
    if backward:
        grads = next(n for n in graph.nodes if n.op == "output").args[0]
        for ds_id, grad in enumerate(grads[:num_params]):
            if isinstance(grad, Node):
                with graph.inserting_after(grad):
                    graph.call_function(REDUCE, (grad, runtime_id, ds_id))
    graph.lint()
    gm.recompile()
    return gm


def capture(model: torch.nn.Module, inputs: tuple) -> Captured:
    """AOT forward and backward graphs of ``model``, with the ZeRO-3 graph ops in traced order."""
    names = [name for name, _ in model.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in model.named_parameters()]
    graphs: Dict[str, GraphModule] = {}

    def partition(joint, joint_inputs, **kwargs):
        primals = [n for n in joint.graph.nodes if n.op == "placeholder"][:len(params)]
        derived = set(primals)
        for node in joint.graph.nodes:
            if node.op == "call_function" and node.target in PARAM_VIEWS and node.args[0] in derived:
                derived.add(node)
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def keep(name):

        def compiler(gm, example_inputs):
            graphs[name] = gm
            return gm

        return compiler

    def run(*args):
        return functional_call(model, dict(zip(names, args[:len(params)])), args[len(params):])

    aot_function(run, keep("fw"), keep("bw"), partition_fn=partition)(*params, *inputs).backward()
    runtime = FakeRuntime([p.detach() for p in params])
    runtime_id = registry.register(runtime)
    fw = insert_zero3_ops(graphs["fw"], runtime_id, len(params), backward=False)
    bw = insert_zero3_ops(graphs["bw"], runtime_id, len(params), backward=True)
    fw_args = [p.detach() for p in params] + list(inputs)
    with torch.no_grad():
        saved = list(fw(*fw_args))[1:]
    return Captured(fw, bw, fw_args, saved + [torch.ones(())], runtime)


def gpt_inputs(vocab: int, seq: int, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (2, seq), generator=generator),
            torch.randint(0, vocab, (2, seq), generator=generator))


def make_gpt(layers: int, dim: int, heads: int, vocab: int = 61, seq: int = 8) -> Captured:
    torch.manual_seed(0)
    return capture(TinyGPT(vocab=vocab, dim=dim, heads=heads, layers=layers, seq=seq), gpt_inputs(vocab, seq))


@pytest.fixture(scope="module")
def models() -> Dict[str, Captured]:
    return {"gpt": make_gpt(layers=2, dim=16, heads=2), "deep": make_gpt(layers=12, dim=16, heads=2)}


def clone(gm: GraphModule) -> GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return GraphModule(gm, graph)


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
    for node in nodes:
        if node.target is GATHER:
            issued[node] = unread[node] = None
        for source in node.all_input_nodes:
            unread.pop(source, None)
        if node not in lazy and node.target is not RELEASE:
            assert len(unread) <= prefetch, f"{len(unread)} gathers ahead at {node.name}"


@pytest.mark.parametrize("model, order", [("gpt", "traced"), ("gpt", "first_use"), ("deep", "first_use")])
def test_same_values_and_collective_order(models, model, order):
    captured = models[model]
    for which, args in (("fw", captured.fw_args), ("bw", captured.bw_args)):
        traced = getattr(captured, which)
        scheduled = fast_free_schedule(clone(traced), prefetch=1, collective_order=order)
        captured.runtime.log.clear()
        with torch.no_grad():
            expected = traced(*args)
            traced_log = list(captured.runtime.log)
            captured.runtime.log.clear()
            got = scheduled(*args)
        assert len(expected) == len(got)
        for want, have in zip(expected, got):
            assert (want is None and have is None) or torch.equal(want, have)
        log = captured.runtime.log
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
        for release in (n for n in scheduled.graph.nodes if n.target is RELEASE):
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
    runtime_id = registry.register(runtime)

    def step(standin, x):
        w = GATHER(standin, runtime_id, 0, None, [], 0)
        y = x @ w.t()  # the view must not count twice
        z = torch.relu(y) @ w  # w is needed again after relu
        RELEASE(w, runtime_id, 0, [y, z])
        return z.sum(0)

    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(step, tracing_mode="fake")(torch.empty(64, 64), torch.empty(8, 64))
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
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(lambda a, b: (a @ b).relu() + a, tracing_mode="fake")(torch.empty(4, 4), torch.empty(4, 4))
    before = signature(gm)
    assert compute_fast_free_order(gm.graph) == list(gm.graph.nodes)
    assert signature(fast_free_schedule(gm)) == before


@pytest.mark.parametrize("knobs", [{"prefetch": -1}, {"prefetch": 1.5}, {"collective_order": "random"}])
def test_bad_knobs_are_named(knobs):
    with pytest.raises(ValueError, match=next(iter(knobs))):
        fast_free_schedule(_small_graph(), **knobs)

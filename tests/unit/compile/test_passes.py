# SPDX-License-Identifier: Apache-2.0
"""Unit tests of the graph passes on small traced graphs: no process group, no DeepSpeed engine."""
import operator

import pytest
import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from deepspeed.compile.graph import rewrite
from deepspeed.compile.graph.nodes import META_DS_ID, downcast_dtype, is_alias, output_args
from deepspeed.compile.graph.recompute import RECOMPUTE, choose_kept_by_reuse, reuse_distances, tag_param_aliases_pass
from deepspeed.compile.graph.saved import saved_for_backward
from deepspeed.compile.runtime.ops import GATHER, REDUCE, REDUCE_MM, RELEASE
from graphs import FakeRuntime, clone, trace

aten = torch.ops.aten


def _qkv_graph() -> GraphModule:
    """A fused QKV weight split in forward, transposed, and downcast: every kind of parameter alias."""

    def f(w, x):
        q, k, v = w.split(4, dim=0)
        wt = q.t().to(torch.bfloat16)
        return (x.to(torch.bfloat16) @ wt).float().sum() + (x @ k.t()).sum() + v.sum()

    gm = trace(f, (12, 4), (3, 4))
    next(n for n in gm.graph.nodes if n.op == "placeholder").meta[META_DS_ID] = 7
    return gm


def test_alias_and_downcast_helpers():
    gm = _qkv_graph()
    split = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.split.Tensor)
    assert is_alias(split) and all(is_alias(u) for u in split.users if u.target is operator.getitem)
    casts = [n for n in gm.graph.nodes if downcast_dtype(n) is not None]
    assert {downcast_dtype(n) for n in casts} == {torch.bfloat16}
    ups = [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default
           and n.kwargs.get("dtype") == torch.float32]
    assert ups and all(downcast_dtype(n) is None for n in ups)  # an upcast is not a downcast
    assert not any(is_alias(n) for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)


def test_tag_marks_exactly_the_parameter_aliases_and_downcasts():
    gm = tag_param_aliases_pass(_qkv_graph())
    tagged = {n for n in gm.graph.nodes if n.meta.get(RECOMPUTE) == CheckpointPolicy.MUST_RECOMPUTE}
    weight = next(n for n in gm.graph.nodes if n.op == "placeholder")
    x = [n for n in gm.graph.nodes if n.op == "placeholder"][1]
    # split, its getitems, t of q and k, and the downcast of q's transpose: those and nothing else
    assert sorted(str(n.target) for n in tagged) == sorted(
        [str(torch.ops.aten.split.Tensor)] + [str(operator.getitem)] * 3 + [str(torch.ops.aten.t.default)] * 2
        + [str(torch.ops.aten._to_copy.default)])
    assert any(downcast_dtype(n) == torch.bfloat16 for n in tagged)
    # nothing that computes, and nothing derived from the activation input
    assert not any(n.target is torch.ops.aten.mm.default for n in tagged)
    assert not any(x in n.all_input_nodes and downcast_dtype(n) for n in tagged)
    assert weight not in tagged


def _gathered_graph(runtime_id):
    def f(standin, x):
        w = GATHER(standin, runtime_id, 3, None, [], "")
        return (x.to(torch.bfloat16) @ w.to(torch.bfloat16).t()).float()  # autocast's pattern: cast, then view

    return make_fx(f)(torch.empty(5, 4), torch.randn(2, 4))


def test_fold_downcast_and_release_after_last_reader():
    runtime = FakeRuntime({3: torch.randn(5, 4)})
    gm = _gathered_graph(runtime.id)
    x = torch.randn(2, 4)
    reference = gm(torch.empty(5, 4), x)
    gm = rewrite.fold_downcasts_pass(gm)
    gm = rewrite.insert_releases_pass(gm, runtime_id=runtime.id)
    gm.graph.lint()
    gm.recompile()
    gathers = [n for n in gm.graph.nodes if n.target is GATHER]
    releases = [n for n in gm.graph.nodes if n.target is RELEASE]
    assert len(gathers) == 1 and gathers[0].args[3] == torch.bfloat16  # the cast moved into the gather
    assert len(releases) == 1 and releases[0].args[3], "release must wait on the readers' outputs"
    order = list(gm.graph.nodes)
    readers = [n for n in order if gathers[0] in n.all_input_nodes and n is not releases[0]]
    assert all(order.index(r) < order.index(releases[0]) for r in readers)
    runtime.calls.clear()
    assert torch.equal(gm(torch.empty(5, 4), x), reference)  # gather(cast) == cast(gather), bitwise
    assert [c[0] for c in runtime.calls] == ["gather", "release"] and runtime.calls[0][2] == torch.bfloat16


def test_insert_reduces_returns_none_and_reduces_each_parameter_gradient():
    def bw(grad_out, x):
        return grad_out.t() @ x, grad_out.sum(0), grad_out @ torch.ones(4, 4)

    gm = make_fx(bw)(torch.randn(2, 4), torch.randn(2, 4))
    runtime = FakeRuntime({})
    gm = rewrite.insert_reduces_pass(gm, runtime_id=runtime.id, grad_ds_ids=[11, 12, None])
    gm.recompile()
    outs = output_args(gm.graph)
    assert outs[0] is None and outs[1] is None and outs[2] is not None
    g, x = torch.randn(2, 4), torch.randn(2, 4)
    result = gm(g, x)
    assert result[0] is None and result[1] is None
    reduced = {c[1]: c[2] for c in runtime.calls if c[0] == "reduce"}
    assert torch.equal(reduced[11], g.t() @ x) and torch.equal(reduced[12], g.sum(0))
    assert sum(n.target is REDUCE for n in gm.graph.nodes) == 2


def test_pin_gathers_makes_each_gathers_scheduled_position_a_dependency():
    """Each gather waits for the closest compute node before it (not for a release or a reduce), so inductor cannot
    hoist it above its scheduled place; the graph computes the same values."""
    runtime = FakeRuntime({5: torch.randn(4, 4), 6: torch.randn(4, 4)})

    def fw(x, standin, standin2):
        h = x.relu()
        w = GATHER(standin, runtime.id, 5, None, [], "")
        h = h @ w
        w2 = GATHER(standin2, runtime.id, 6, None, [], "")
        return h @ w2

    args = (torch.randn(2, 4), torch.randn(4, 4), torch.randn(4, 4))
    gm = make_fx(fw)(*args)
    expected = gm(*args)
    gm = rewrite.pin_gathers_pass(gm)
    gm.recompile()
    gathers = [n for n in gm.graph.nodes if n.target is GATHER]
    computed = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not GATHER]
    assert [n.args[4] for n in gathers] == [[computed[0]], [computed[1]]], [n.args for n in gathers]
    assert all(g.args[4][0] in g.all_input_nodes for g in gathers)  # a dependency, not only a position
    assert torch.equal(gm(*args), expected)


def test_chain_collectives_makes_the_graph_order_of_gathers_and_reduces_data_dependencies():
    """Each collective waits for the one before it: a reduce after a gather, a gather after a reduce (the second
    gather chained to the first reduce's gradient), a reduce after a reduce."""
    runtime = FakeRuntime({5: torch.randn(4, 4), 6: torch.randn(4, 4)})

    def bw(grad_out, x, standin, standin2):
        w = GATHER(standin, runtime.id, 5, None, [], "")
        weight_grad = grad_out.t() @ x
        w2 = GATHER(standin2, runtime.id, 6, None, [], "")
        return weight_grad, grad_out.sum(0), grad_out @ w @ w2

    gm = make_fx(bw)(torch.randn(2, 4), torch.randn(2, 4), torch.randn(4, 4), torch.randn(4, 4))
    gm = rewrite.insert_reduces_pass(gm, runtime_id=runtime.id, grad_ds_ids=[11, 12, None])
    gm = rewrite.chain_collectives_pass(gm)
    collectives = [n for n in gm.graph.nodes if n.target in (GATHER, REDUCE)]
    assert [n.target for n in collectives] == [GATHER, REDUCE, GATHER, REDUCE], collectives
    for before, node in zip(collectives, collectives[1:]):
        token = before if before.target is GATHER else before.args[0]  # a reduce's gradient, which it mutates
        after = node.args[4]
        assert token in after, (node, after)
        # a dependency, not only a position: the token is among the node's inputs
        assert token in node.all_input_nodes
    assert collectives[0].args[4] == []  # the first waits for nothing
    rewrite.chain_collectives_pass(gm)  # idempotent
    assert [len(n.args[4]) for n in collectives] == [0, 1, 1, 1]


def _run_recording(gm: GraphModule, runtime: FakeRuntime, args: tuple):
    """The graph's results on ``args``, and the runtime calls its ops made."""
    gm.recompile()
    runtime.calls.clear()
    out = gm(*args)
    return out, list(runtime.calls)


def test_defer_reduces_moves_each_reduce_past_fusible_code_only():
    """A norm-like backward: the weight's gradient (a sum over the rows) comes out before the pointwise ops of the
    input's gradient. Deferred, its reduce sits just before the matmul after them. A reduce stops before a gather
    and before a reader of its gradient; the reduces keep their order, the results are the same."""
    runtime = FakeRuntime({5: torch.randn(4, 4)})

    def bw(grad_out, normed, w, m, standin):
        gw = (grad_out * normed).sum(0)  # the weight's gradient
        gx = grad_out * w * 2.0  # the input's gradient, fusible with the sum
        g_m = gx.t() @ m  # a matmul: a kernel of its own under inductor
        gathered = GATHER(standin, runtime.id, 5, None, [], "")
        g_b = g_m.sum(1)
        z = gx * 3.0
        return gw, g_m, g_b, g_b.sum() + z.sum() + (gx @ gathered).sum()

    args = (torch.randn(3, 4), torch.randn(3, 4), torch.randn(4), torch.randn(3, 4), torch.randn(4, 4))
    gm = make_fx(bw)(*args)
    gm = rewrite.insert_reduces_pass(gm, runtime_id=runtime.id, grad_ds_ids=[11, 12, 13, None])
    reference = clone(gm)
    gm = rewrite.defer_reduces_pass(gm)
    nodes = list(gm.graph.nodes)
    reduces = [n for n in nodes if n.target is REDUCE]
    assert [r.args[2] for r in reduces] == [11, 12, 13]
    following = {r.args[2]: nodes[nodes.index(r) + 1] for r in reduces}
    assert following[11].target is torch.ops.aten.mm.default  # past the input gradient's pointwise ops
    grad_out = nodes[0]
    assert nodes.index(reduces[0]) > max(nodes.index(n) for n in grad_out.users)
    assert following[12].target is GATHER
    assert reduces[2].args[0] in following[13].all_input_nodes  # the sum that reads its gradient
    assert nodes.index(reduces[2]) > nodes.index(reduces[2].args[0]) + 1  # moved past ``z``
    (out_ref, calls_ref), (out_new, calls_new) = [_run_recording(graph, runtime, args) for graph in (reference, gm)]
    assert torch.equal(out_ref[3], out_new[3]) and out_new[:3] == (None, None, None)
    assert [c[:2] for c in calls_new] == [c[:2] for c in calls_ref] == [("reduce", 11), ("reduce", 12),
                                                                        ("gather", 5), ("reduce", 13)]
    assert all(torch.equal(a[2], b[2]) for a, b in zip(calls_ref, calls_new) if a[0] == "reduce")
    rewrite.defer_reduces_pass(gm)  # idempotent
    assert [n.name for n in gm.graph.nodes] == [n.name for n in nodes]


def test_fuse_matmul_reduces_only_where_the_gradient_is_the_matmuls_result_as_it_is():
    """A linear weight's gradient as AOTAutograd leaves it (``t(t(mm(t(x), g)))``: the matmul in the weight's own
    layout) becomes one fused reduce, chained like a reduce; not a transposed result (another layout), a matmul read
    by something else too, or one changed in place. The fused reduce takes the matmul's place (its operands are
    freed as early as before), or the reduce's where another collective lies between (their order is kept). The
    reduced values and the graph's results are the unfused graph's, bit for bit."""
    runtime = FakeRuntime({})

    def bw(g, x, h):
        weight = torch.mm(x.t(), g).t().t()  # fused
        transposed = torch.mm(x.t(), g).t()  # another layout than the matmul's: kept
        shared = torch.mm(h.t(), g)  # also read by the input gradient below: kept
        scaled = torch.mm(h.t(), g).mul_(2.0)  # changed in place: kept
        return weight, transposed, shared, scaled, shared.sum()

    args = (torch.randn(5, 4), torch.randn(5, 4), torch.randn(5, 4))  # square products: a transpose keeps the shape
    gm = make_fx(bw)(*args)
    gm = rewrite.insert_reduces_pass(gm, runtime_id=runtime.id, grad_ds_ids=[11, 12, 13, 14, None])
    reduces = {n.args[2]: n for n in gm.graph.nodes if n.target is REDUCE}
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    mms[1].append(reduces[11])  # code between the weight gradient's matmul and its reduce (another matmul)
    reference = clone(gm)
    moved = clone(gm)  # and, in a copy, the reduce after another collective
    moved_reduces = {n.args[2]: n for n in moved.graph.nodes if n.target is REDUCE}
    moved_reduces[12].append(moved_reduces[11])
    gm = rewrite.chain_collectives_pass(rewrite.fuse_matmul_reduces_pass(gm))
    fused = [n for n in gm.graph.nodes if n.target is REDUCE_MM]
    assert [n.args[3] for n in fused] == [11], [n.args for n in fused]
    first_mm = next(n for n in reference.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert fused[0].prev.name == first_mm.prev.name  # the matmul's place
    moved = rewrite.fuse_matmul_reduces_pass(moved)
    order = [n.args[2 if n.target is REDUCE else 3] for n in moved.graph.nodes if n.target in (REDUCE, REDUCE_MM)]
    assert order == [12, 11, 13, 14], order
    assert [n.args[2] for n in gm.graph.nodes if n.target is REDUCE] == [12, 13, 14]
    assert sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes) == 3  # the fused one's went
    following = next(n for n in gm.graph.nodes if n.target is REDUCE)
    assert fused[0] in following.args[4] and fused[0] in following.all_input_nodes  # the token chains the next
    (out_ref, calls_ref), (out_new, calls_new) = [_run_recording(graph, runtime, args) for graph in (reference, gm)]
    assert torch.equal(out_ref[4], out_new[4])
    assert [c[:2] for c in calls_new] == [c[:2] for c in calls_ref] == [("reduce", i) for i in (11, 12, 13, 14)]
    assert all(torch.equal(a[2], b[2]) for a, b in zip(calls_ref, calls_new))
    assert torch.equal(calls_new[0][2], torch.mm(args[1].t(), args[0]))


def test_saved_for_backward_splits_parameter_derived_bytes():
    def fw(standin, x):
        w = GATHER(standin, 1, 0, None, [], "")
        wt = w.t()
        h = x @ wt
        return h.sum(), wt, h  # one user output, then two saved values: a parameter alias and an activation

    gm = trace(fw, (8, 4), (3, 4))
    report = saved_for_backward(gm, num_fwd_outputs=1)
    assert report.param_bytes == 8 * 4 * 4 and report.param_tensors == 1
    assert report.other_bytes == 3 * 8 * 4 and report.other_tensors == 1


def _chain_joint() -> GraphModule:
    """The joint forward/backward graph of three gathered linear maps in a chain (the input needs no gradient):
    forward reads w1, w2, w3 in turn; backward reads w3, then w2 (the input gradients), never w1."""
    runtime = FakeRuntime({})
    joints = []

    def partition(joint, joint_inputs, **kwargs):
        joints.append(joint)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def f(s1, s2, s3, x):
        h = x @ GATHER(s1, runtime.id, 1, None, [], "").t()
        h = torch.relu(h @ GATHER(s2, runtime.id, 2, None, [], "").t())
        return (h @ GATHER(s3, runtime.id, 3, None, [], "").t()).sum()

    shapes = {1: (8, 4), 2: (8, 8), 3: (2, 8)}  # 32, 64 and 16 elements
    runtime.params = {ds_id: torch.randn(shape) for ds_id, shape in shapes.items()}
    inputs = [torch.randn(shape, requires_grad=True) for shape in shapes.values()] + [torch.randn(3, 4)]
    aot_function(f, lambda gm, _: make_boxed_func(gm), lambda gm, _: make_boxed_func(gm), partition_fn=partition)(*inputs).backward()
    return joints[0]


def test_reuse_distance_counts_what_is_used_between_forward_and_backward():
    """As eager ZeRO-3's ``stage3_max_reuse_distance``: w3 is read again in backward right after its forward read
    (distance 0); between w2's last forward read and its first backward read, w3 is read once in each direction
    (2 x 16); w1 is never read in backward, so there is nothing to keep. Parameters outside the graph count twice."""
    joint = _chain_joint()
    assert reuse_distances(joint) == {2: 32, 3: 0}
    assert reuse_distances(joint, outside_numel=100) == {2: 232, 3: 200}
    assert choose_kept_by_reuse(joint, 0) == {}
    assert choose_kept_by_reuse(joint, 1) == {3: 16 * 4}
    assert choose_kept_by_reuse(joint, 33) == {2: 64 * 4, 3: 16 * 4}
    assert choose_kept_by_reuse(joint, int(1e9)) == {2: 64 * 4, 3: 16 * 4}
    assert choose_kept_by_reuse(joint, 33, outside_numel=100) == {}


def test_eager_zero3_s_prefetch_window_keeps_parameters_at_reuse_distance_zero():
    """Eager ZeRO-3's prefetcher marks a parameter it walks past still gathered as wanted at that later use, so the
    release after forward skips it: with a prefetch window, the parameters whose backward read comes within that
    many elements of gathering (their own included) are kept even at ``stage3_max_reuse_distance`` 0, the nearest
    first and no more than the window in all. w3's reads are adjacent (16 elements of its own); between w2's reads
    only w3 is used (16 elements, counted once, though it is used in both directions), and w2 has 64."""
    joint = _chain_joint()
    assert choose_kept_by_reuse(joint, 0, prefetch_window=0) == {}
    assert choose_kept_by_reuse(joint, 0, prefetch_window=15) == {}
    assert choose_kept_by_reuse(joint, 0, prefetch_window=16) == {3: 16 * 4}
    assert choose_kept_by_reuse(joint, 0, prefetch_window=79) == {3: 16 * 4}
    assert choose_kept_by_reuse(joint, 0, prefetch_window=80) == {2: 64 * 4, 3: 16 * 4}
    # the reuse distance keeps w3 on its own; the window still has room for w2 (the total is what the window bounds)
    assert choose_kept_by_reuse(joint, 1, prefetch_window=80) == {2: 64 * 4, 3: 16 * 4}
    # parameters outside the graph count twice in the window too (gathered in forward and again in backward)
    assert choose_kept_by_reuse(joint, 0, outside_numel=100, prefetch_window=279) == {3: 16 * 4}
    assert choose_kept_by_reuse(joint, 0, outside_numel=100, prefetch_window=280) == {2: 64 * 4, 3: 16 * 4}


def test_untraced_twins_have_the_ops_schemas_and_reach_the_same_runtime():
    """Inductor's final graphs call ``dsc::run_*`` in place of our custom ops (``ops.UNTRACED_CALLS``): inductor
    orders and keeps them by their schema, so each must declare the same arguments, mutations and results; and a
    call must do what the op does."""
    from deepspeed.compile.runtime.ops import UNTRACED_CALLS

    def signature(schema):
        def alias(a):
            return None if a.alias_info is None else a.alias_info.is_write
        return ([(a.name, str(a.type), alias(a)) for a in schema.arguments],
                [(str(r.type), alias(r)) for r in schema.returns])

    from deepspeed.compile.runtime.ops import TP_SUM_START, TP_SUM_WAIT
    assert set(UNTRACED_CALLS) == {GATHER, RELEASE, REDUCE, REDUCE_MM, TP_SUM_START, TP_SUM_WAIT}
    for op, twin in UNTRACED_CALLS.items():
        assert twin._schema.name == op._schema.name.replace("dsc::", "dsc::run_")
        assert signature(twin._schema) == signature(op._schema)
    assert signature(UNTRACED_CALLS[REDUCE]._schema)[0][0][2] is True  # the gradient is declared mutated
    assert signature(UNTRACED_CALLS[RELEASE]._schema)[0][0][2] is True  # so is the released tensor
    assert signature(UNTRACED_CALLS[TP_SUM_WAIT]._schema)[0][0][2] is True  # and the buffer a sum lands in

    full = torch.randn(3, 4)
    runtime = FakeRuntime({7: full})
    param = torch.nn.Parameter(torch.zeros(0))
    grad = torch.randn(3, 4)
    with torch.no_grad():
        gathered = UNTRACED_CALLS[GATHER](param, runtime.id, 7, torch.bfloat16, [], "")
        assert torch.equal(gathered, full.to(torch.bfloat16))
        UNTRACED_CALLS[RELEASE](gathered, runtime.id, 7, [])
        UNTRACED_CALLS[REDUCE](grad, runtime.id, 7, param, [])
        mat1, mat2 = torch.randn(3, 5), torch.randn(5, 4)
        token = UNTRACED_CALLS[REDUCE_MM](mat1, mat2, runtime.id, 7, param, [])
    assert runtime.ops() == [("gather", 7), ("release", 7), ("reduce", 7), ("reduce", 7)]
    assert runtime.calls[1][2] == torch.bfloat16 and torch.equal(runtime.calls[2][2], grad)
    assert torch.equal(runtime.calls[3][2], mat1 @ mat2) and token.numel() == 0
    # no compiler drops the fused reduce for its unused token result
    assert all(torch._library.utils.is_impure(op) for op in (REDUCE_MM, UNTRACED_CALLS[REDUCE_MM]))


# ----- tensor parallelism's sums in flight -----------------------------------------------------------------------
class _TwoRankGroup:
    """Stands in for a tensor-parallel group of two ranks fed the same values: a sum over it is twice the addend.
    Records the sums in ``events``; a started sum is known by its buffer, as the runtime's group knows it."""

    def __init__(self):
        self.events = []
        self.in_flight = set()

    def all_reduce(self, x):
        self.events.append("sum")
        return x * 2

    def start_all_reduce(self, x):
        total = (x * 2).contiguous()
        self.events.append("start")
        self.in_flight.add(total.data_ptr())
        return total

    def finish_all_reduce(self, total):
        self.events.append("wait")
        self.in_flight.remove(total.data_ptr())
        return total


def test_tensor_sums_are_in_flight_while_the_weight_gradients_are_computed():
    """A Llama MLP as AutoTP shards it, with its collectives as ``graph/tensor.py`` places them: the backward's sum
    of the input gradient (gate's and up's, one sum) is started where its addend is computed and waited for before
    its first reader, with the three weight gradients (which the addend does not depend on) computed in between. The
    gradients are bitwise those of the graph with the synchronous sum."""
    from deepspeed.compile.graph.tensor import overlap_tensor_sums
    from deepspeed.compile.runtime.ops import TP_SUM, TP_SUM_START, TP_SUM_WAIT
    runtime = FakeRuntime({})
    runtime.tensor = group = _TwoRankGroup()

    def mlp(x, norm, w_gate, w_up, w_down):
        h = torch.ops.dsc.tp_enter(torch.nn.functional.rms_norm(x, (16, ), norm), runtime.id)
        act = torch.nn.functional.silu(h @ w_gate.t()) * (h @ w_up.t())
        return (x + torch.ops.dsc.tp_sum(act @ w_down.t(), runtime.id)).pow(2).sum()

    graphs = {}

    def backward_compiler(gm, _):
        graphs["synchronous"], graphs["overlapped"] = clone(gm), clone(gm)
        graphs["sums"] = overlap_tensor_sums(graphs["overlapped"], runtime.id)
        return make_boxed_func(gm)

    inputs = [torch.randn(6, 16), torch.randn(16), torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 8)]
    inputs = [t.requires_grad_() for t in inputs]
    aot_function(mlp, lambda gm, _: make_boxed_func(gm), backward_compiler)(*inputs).backward()
    graph = graphs["overlapped"].graph
    assert graphs["sums"] == 1 and not [n for n in graph.nodes if n.target is TP_SUM]
    nodes = list(graph.nodes)
    start, = [i for i, n in enumerate(nodes) if n.target is TP_SUM_START]
    wait, = [i for i, n in enumerate(nodes) if n.target is TP_SUM_WAIT]
    products = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    assert len(products) == 6  # each layer's input gradient and weight gradient
    assert sum(start < i < wait for i in products) == 3, graph  # the weight gradients, while the sum is in flight
    assert nodes[start].args[0] is nodes[start - 1]  # started where its addend is computed
    assert nodes[wait].args[0] is nodes[start] and nodes[start] in nodes[wait + 1].all_input_nodes

    # the same gradients, from the saved values of a second forward
    saved = {}

    def keep_args(gm, _):
        def run(args):
            saved["args"] = list(args)
            return gm(*args)
        run._boxed_call = True
        return run
    aot_function(mlp, lambda gm, _: make_boxed_func(gm), keep_args)(*inputs).backward()
    group.events.clear()
    expected = graphs["synchronous"](*saved["args"])
    got = graphs["overlapped"](*saved["args"])
    assert group.events == ["sum", "start", "wait"] and not group.in_flight
    assert all(torch.equal(a, b) for a, b in zip(expected, got) if a is not None)


# ----- the eager backend's callable ---------------------------------------------------------------------------
_callers: list = []


def _record_caller(x):
    """Called by a graph: records the code flags of the frame that called it (the graph's)."""
    import sys
    _callers.append(sys._getframe(1).f_code.co_flags)
    return x


def _fail(x):
    raise ValueError("raised inside the graph")


def _graph_calling(fn) -> GraphModule:
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    called = graph.call_function(fn, (graph.call_function(torch.ops.aten.mul.Tensor, (x, y)), ))
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (called, x)), ))
    return GraphModule(torch.nn.Module(), graph)


def test_eager_backend_runs_a_graph_in_its_own_heap_frame():
    """``boxed_eager``: the graph's result, its argument list cleared (the boxed convention), its code running as a
    generator's frame (kept in the generator object, off the thread's data stack: ``heap_frame_function``), and an
    error inside it raised as it is, its traceback showing the graph's source line."""
    import inspect
    import traceback
    from deepspeed.compile.driver.eager_code import boxed_eager
    x, y = torch.randn(3), torch.randn(3)
    run = boxed_eager(_graph_calling(_record_caller))
    args = [x, y]
    out = run(args)
    assert args == [] and len(out) == 1 and torch.equal(out[0], x * y + x)
    assert _callers and _callers[-1] & inspect.CO_GENERATOR, _callers
    failing = boxed_eager(_graph_calling(_fail))
    with pytest.raises(ValueError, match="raised inside the graph") as raised:
        failing([x, y])
    text = "".join(traceback.format_exception(raised.value))
    assert "deepspeed-compile graph" in text and "_fail(" in text, text


def test_eager_graph_code_fx_runs_fx_code_as_it_is():
    """``compile.eager_graph_code: "fx"``: FX's generated ``forward`` runs as it is (a plain frame, FX's own source in
    tracebacks), boxed, with the same result as ``"direct"``; anything else is refused naming the option."""
    import inspect
    import traceback
    from deepspeed.compile.driver.eager_code import boxed_eager
    x, y = torch.randn(3), torch.randn(3)
    _callers.clear()
    run = boxed_eager(_graph_calling(_record_caller), "fx")
    args = [x, y]
    out = run(args)
    assert args == [] and torch.equal(out[0], boxed_eager(_graph_calling(_record_caller))([x, y])[0])
    assert not _callers[0] & inspect.CO_GENERATOR and _callers[1] & inspect.CO_GENERATOR, _callers
    with pytest.raises(ValueError, match="raised inside the graph") as raised:
        boxed_eager(_graph_calling(_fail), "fx")([x, y])
    text = "".join(traceback.format_exception(raised.value))
    assert "deepspeed-compile graph" not in text and "_fail(" in text, text
    with pytest.raises(ValueError, match="compile.eager_graph_code"):
        boxed_eager(_graph_calling(_fail), "plain")


def test_eager_backend_calls_aten_ops_past_their_python_wrapper():
    """``heap_frame_function`` binds each ATen ``OpOverload`` of the graph to the C++ function behind it: the source
    calls ``aten_mul_Tensor(...)``, not ``torch.ops.aten.mul.Tensor(...)``, with the same result; an alias that a
    graph's own local would shadow is left as FX wrote it."""
    import linecache
    from deepspeed.compile.driver.eager_code import heap_frame_function
    x, y = torch.randn(3), torch.randn(3)

    def source(gm: GraphModule):
        body = heap_frame_function(gm)
        text = "".join(linecache.getlines(body.__code__.co_filename))
        try:
            next(body(gm, x, y))
        except StopIteration as done:
            return text, done.value
        raise AssertionError("the graph's code yielded")

    text, out = source(_graph_calling(_record_caller))
    assert "aten_mul_Tensor(x, y)" in text and "aten_add_Tensor(" in text and "torch.ops." not in text, text
    assert torch.equal(out[0], x * y + x)
    graph = torch.fx.Graph()
    a, b = graph.placeholder("aten_mul_Tensor"), graph.placeholder("y")  # a local named as the alias would be
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (graph.call_function(torch.ops.aten.mul.Tensor,
                                                                                      (a, b)), a)), ))
    text, out = source(GraphModule(torch.nn.Module(), graph))
    assert "torch.ops.aten.mul.Tensor(" in text, text
    assert "aten_add_Tensor(" in text and torch.equal(out[0], x * y + x)


def _attention_masks(model, batch):
    """Run ``model`` compiled with the causal-mask passes; returns (attentions given is_causal, attentions left to
    the run-time decision, each SDPA's mask and is_causal after the passes, the compiled model's logits, the
    gradients of its parameters)."""
    from deepspeed.compile.graph.masks import causal_masks_pass, run_time_causal_pass
    seen = {}

    def backend(gm, example_inputs):
        seen["changed"], undecided = causal_masks_pass(gm)
        seen["at run time"] = run_time_causal_pass(gm, undecided)
        seen["calls"] = [(n.kwargs.get("attn_mask"), n.kwargs.get("is_causal")) for n in gm.graph.nodes
                         if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
        return gm.forward

    torch._dynamo.reset()
    model.zero_grad()
    logits = torch.compile(model, backend=backend)(**batch).logits
    logits.square().mean().backward()
    torch._dynamo.reset()
    return seen["changed"], seen["at run time"], seen["calls"], logits, _grads(model)


def _grads(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("case", ["causal", "padded", "unpadded", "sliding_window", "dynamic"])
def test_a_causal_mask_becomes_is_causal_at_compile_time_or_at_run_time(case):
    """A `transformers` model run without a cache (as in training) builds its causal mask in the graph when traced;
    where the mask is a constant, the pass gives those attentions is_causal=True, as the eager model has. A constant
    mask that is not causal (a sliding window shorter than the sequence) stays. A mask read from an input (an
    attention mask, padded or not) or built over a symbolic length goes to ``dsc::attention``, which decides per run.
    Every output and gradient equals the eager model's (the same CPU kernel, causal or masked, as eager SDPA takes)."""
    from models import tiny_llama
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 16))
    batch = {"input_ids": ids}
    if case == "sliding_window":
        model = MistralForCausalLM(MistralConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=4, attn_implementation="sdpa", use_cache=False))
    else:
        model = tiny_llama()
    if case in ("padded", "unpadded"):
        batch["attention_mask"] = torch.ones_like(ids)
        if case == "padded":
            batch["attention_mask"][1, :3] = 0
    if case == "dynamic":  # a symbolic length, as after a length change or under sequence parallelism
        torch._dynamo.mark_dynamic(ids, 1)
    changed, at_run_time, calls, logits, grads = _attention_masks(model, batch)
    expected = {"causal": (2, 0), "sliding_window": (0, 0)}.get(case, (0, 2))
    assert (changed, at_run_time) == expected, (changed, at_run_time, calls)
    if case == "causal":
        assert len(calls) == 2 and all(mask is None and causal for mask, causal in calls), calls
    else:
        assert len(calls) == 2 - at_run_time and all(mask is not None for mask, _ in calls), calls
    eager = model(**batch).logits
    eager.square().mean().backward()
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-6)
    eager_grads = _grads(model)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def _run_time_rewrites(fn, *args) -> int:
    """How many attentions of ``fn``'s graph the passes leave to the run-time decision; checks ``fn``'s outputs."""
    from deepspeed.compile.graph.masks import causal_masks_pass, run_time_causal_pass
    seen = {}

    def backend(gm, example_inputs):
        _, undecided = causal_masks_pass(gm)
        seen["at run time"] = run_time_causal_pass(gm, undecided)
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    out = torch.compile(fn, backend=backend)(*args)
    torch.manual_seed(0)
    torch.testing.assert_close(out, fn(*args), rtol=0, atol=0)
    torch._dynamo.reset()
    return seen["at run time"]


def test_the_run_time_decision_takes_only_attentions_it_computes_bitwise():
    """``dsc::attention`` runs SDPA's CPU kernel without dropout, on operands of one dtype, under a mask no gradient
    reaches: an attention with dropout, one that autocast casts, one whose mask is a trained bias, one with grouped
    key/value heads, or one causal besides its mask stays SDPA (the eager model's call, as traced); a plain one
    does not."""
    import torch.nn.functional as F
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    mask[1, ..., 0] = False
    mask[1, 0, 0, 0] = True

    def plain(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def dropout(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)

    def autocast(q, k, v, mask):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def bias(q, k, v, weight):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=weight * 2)

    def grouped(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], attn_mask=mask, enable_gqa=True)

    def causal_and_mask(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)

    assert _run_time_rewrites(plain, q, k, v, mask) == 1
    assert _run_time_rewrites(dropout, q, k, v, mask) == 0
    assert _run_time_rewrites(autocast, q, k, v, mask) == 0
    assert _run_time_rewrites(bias, q, k, v, torch.zeros(8, 8, requires_grad=True)) == 0
    assert _run_time_rewrites(grouped, q, k, v, mask) == 0
    assert _run_time_rewrites(causal_and_mask, q, k, v, mask) == 0


def _masks(length: int):
    keep = torch.ones(length, length, dtype=torch.bool).tril()
    padded = keep[None, None].repeat(2, 1, 1, 1)
    padded[1, :, :, :3] = False
    padded[1, :, :3, 0] = True  # a row may not be all masked (SDPA's output there is NaN)
    return {"causal bool": (keep[None, None].expand(2, 1, length, length), True),
            "causal -inf": (torch.zeros(length, length).masked_fill(~keep, float("-inf")), True),
            "causal min": (torch.zeros(1, 1, length, length).masked_fill(~keep, torch.finfo(torch.float32).min), True),
            "padded": (padded, False), "bias": (torch.zeros(length, length).masked_fill(~keep, -1.0), False),
            "upper": (keep.T.contiguous(), False), "window": (keep & torch.ones_like(keep).triu(-2), False),
            "one row causal": (torch.stack([keep, keep.triu()])[:, None], False)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_run_time_attention_is_sdpa_causal_or_masked_bitwise(dtype):
    """``dsc::causal_flag`` holds for the causal masks only, and ``dsc::attention``'s output and gradients equal
    SDPA's, bitwise: with ``is_causal=True`` where the flag holds (what the eager model passes for that mask), with
    the mask otherwise."""
    import torch.nn.functional as F
    from deepspeed.compile.runtime import ops
    torch.manual_seed(0)
    length = 12
    q, k, v = (torch.randn(2, 4, length, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 4, length, 8, dtype=dtype)
    for name, (mask, causal) in _masks(length).items():
        if mask.is_floating_point():
            mask = mask.to(dtype)
        flag = ops.causal_flag(mask)
        assert bool(flag) == causal, name
        out = ops.attention(q, k, v, mask, flag, None)[0]
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True) if causal else \
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.equal(out, expected), name
        grads = torch.autograd.grad(out, (q, k, v), grad)
        for ours, theirs in zip(grads, torch.autograd.grad(expected, (q, k, v), grad)):
            assert torch.equal(ours, theirs), name
    # the fake kernels' strides are the kernel's (inductor checks them), for query/key/value in the [batch, length,
    # heads, dim] memory layout a model's projections leave them in
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    for mask, _ in list(_masks(length).values())[:4:3]:
        mask = mask.to(dtype) if mask.is_floating_point() else mask
        flag = ops.causal_flag(mask)
        torch.library.opcheck(ops.ATTENTION, (q, k, v, mask, flag, None))
        out, lse = ops.attention(q, k, v, mask, flag, 0.5)
        torch.library.opcheck(torch.ops.dsc.attention_backward.default, (grad, q, k, v, out, lse, mask, flag, 0.5),
                              test_utils=("test_schema", "test_faketensor"))
    assert not bool(ops.causal_flag(torch.ones(length, length, dtype=torch.int64).tril()))
    assert not bool(ops.causal_flag(torch.ones(length, length + 1, dtype=torch.bool).tril()))


def test_only_the_exact_lower_triangle_counts_as_causal():
    from deepspeed.compile.graph.masks import _is_causal
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    assert _is_causal(keep[None, None].expand(2, 1, 5, 5), 5)
    assert _is_causal(torch.zeros(5, 5).masked_fill(~keep, float("-inf")), 5)
    assert _is_causal(torch.zeros(5, 5).masked_fill(~keep, torch.finfo(torch.float32).min), 5)
    assert not _is_causal(torch.zeros(5, 5).masked_fill(~keep, -1.0), 5)  # a bias, not a mask
    assert not _is_causal(keep, 4)
    assert not _is_causal(keep.triu(), 5)
    off = keep.clone()
    off[4, 0] = False
    assert not _is_causal(off, 5)
    assert not _is_causal(keep.to(torch.int64), 5)


def test_in_place_sums_write_into_an_operand_that_dies_there_and_sum_the_same():
    """``in_place_sums_pass`` (eager backend): a sum is written into an operand an ATen op made fresh and nothing else
    reads, with the sum's layout (any contiguous one where only a gradient reduce reads the sum); never into a graph
    input, a gather's buffer, an operand read again (or through a view), a view, an operand whose strides are not the
    sum's, a broadcast operand, or the second operand of a scaled sum. On a GPT's backward graph the tied weight's two
    gradients are summed in place, and every reduced gradient is the same bit for bit."""
    from deepspeed.compile.graph.in_place import in_place_sums_pass
    from graphs import make_gpt

    runtime = FakeRuntime({0: torch.randn(4)})

    def fn(a, b, bias):
        fresh_first = torch.mm(a, b) + torch.mm(b, a)  # the first operand receives it
        view_first = torch.mm(a, b).view(16) + torch.mm(b, a).sum(0).repeat(4)  # the second: the first is a view
        transposed = torch.mm(a, b).t() + torch.mm(b, a)  # the sum takes the view's strides: neither may receive it
        read_again = torch.mm(a, b)
        kept = read_again + a  # read_again is read below, a is an input: not rewritten
        broadcast = bias + torch.mm(a, b) * 2  # the broadcast bias cannot receive it; the product can
        scaled = torch.add(a, torch.mm(a, b), alpha=2)  # only a scaled sum's first operand may receive it
        gathered = GATHER(bias, runtime.id, 0, None, [], "") + torch.mm(a, b).sum(0)  # never into a gather's buffer
        # read by a gradient reduce only, which takes any layout: the contiguous operand receives the transposed sum
        REDUCE(torch.mm(a, b).t() + torch.mm(b, a), runtime.id, 7, None, [])
        return fresh_first, view_first, transposed, kept, read_again.sum(), broadcast, scaled, gathered

    shapes = ((4, 4), (4, 4), (4, ))
    gm = trace(fn, *shapes)
    args = [torch.randn(s) for s in shapes]
    originals = [a.clone() for a in args]
    expected = gm(*args)
    rewritten = clone(gm)
    assert in_place_sums_pass(rewritten) == 5
    sums = [n for n in rewritten.graph.nodes if n.target in (aten.add.Tensor, aten.add_.Tensor)]
    assert [n.target for n in sums] == [aten.add_.Tensor, aten.add_.Tensor, aten.add.Tensor, aten.add.Tensor,
                                        aten.add_.Tensor, aten.add.Tensor, aten.add_.Tensor,
                                        aten.add_.Tensor], rewritten.code
    assert sums[6].args[0].target is aten.sum.dim_IntList and sums[6].args[1].target is GATHER
    assert sums[7].args[0].target is aten.mm.default and sums[7].args[1].target is aten.t.default
    assert sums[0].args[0].target is aten.mm.default and sums[1].args[0].target is aten.repeat.default
    assert sums[4].args[0].target is aten.mul.Tensor and sums[4].args[1].op == "placeholder"
    rewritten.recompile()
    got = rewritten(*args)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    (_, _, first), (_, _, second) = [call for call in runtime.calls if call[0] == "reduce"]
    assert torch.equal(first, second) and not first.is_contiguous() and second.is_contiguous()
    assert all(torch.equal(a, o) for a, o in zip(args, originals))  # no input written

    gpt = make_gpt(layers=2, dim=16, heads=2)
    bw = clone(gpt.bw)
    assert in_place_sums_pass(bw) >= 1
    tied = gpt.fw_args[1]  # TinyGPT's token embedding, also its output head
    assert any(n.target is aten.add_.Tensor and tuple(n.meta["val"].shape) == tuple(tied.shape)
               for n in bw.graph.nodes), bw.code
    bw.recompile()
    gpt.bw(*gpt.bw_args)
    before = [call for call in gpt.runtime.calls if call[0] == "reduce"]
    gpt.runtime.calls.clear()
    bw(*gpt.bw_args)
    after = [call for call in gpt.runtime.calls if call[0] == "reduce"]
    assert len(after) == len(before) == len(gpt.fw_args) - 2  # every parameter's gradient, once
    assert all(a[1] == b[1] and torch.equal(a[2], b[2]) for a, b in zip(after, before))


def test_owned_reduces_are_those_whose_gradient_storage_nothing_else_reads():
    """``owned_reduces_pass`` (eager backend): a reduce calls ``run_reduce_owned`` where its gradient, and every alias
    back to the fresh ATen result whose storage it is, is read by the next alone: a sum written into its operand, a
    view of a matmul. Not a gradient read again, one whose storage a graph output holds, a graph input, or a
    gather's buffer. The runtime is told so; the gradients it receives are the same."""
    from deepspeed.compile.graph.in_place import in_place_sums_pass, owned_reduces_pass
    from deepspeed.compile.runtime.ops import run_reduce_owned
    runtime = FakeRuntime({0: torch.randn(4, 4)})

    def bw(a, b):
        REDUCE(torch.mm(a, b) + torch.mm(b, a), runtime.id, 1, None, [])  # owned, once summed in place
        REDUCE(torch.mm(a, b).view(16), runtime.id, 2, None, [])  # owned: a view of a fresh result
        again = torch.mm(a, b)
        REDUCE(again, runtime.id, 3, None, [])  # read again below
        REDUCE(a, runtime.id, 4, None, [])  # a graph input
        kept = torch.mm(b, a)
        REDUCE(kept.t(), runtime.id, 5, None, [])  # its storage is a graph output
        REDUCE(GATHER(b, runtime.id, 0, None, [], ""), runtime.id, 6, None, [])  # the runtime's buffer
        return again.sum(), kept

    gm = trace(bw, (4, 4), (4, 4))
    args = [torch.randn(4, 4), torch.randn(4, 4)]
    gm(*args)
    before = [call for call in runtime.calls if call[0] == "reduce"]
    in_place_sums_pass(gm)
    assert owned_reduces_pass(gm) == 2
    assert [n.args[2] for n in gm.graph.nodes if n.target is run_reduce_owned] == [1, 2], gm.code
    gm.recompile()
    runtime.calls.clear()
    gm(*args)
    after = [call for call in runtime.calls if call[0] == "reduce"]
    assert runtime.owned == [1, 2]
    assert [c[1] for c in after] == [c[1] for c in before] and all(torch.equal(a[2], b[2]) for a, b in zip(after, before))

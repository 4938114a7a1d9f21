# SPDX-License-Identifier: Apache-2.0
"""Rewrite passes: place the runtime's gather / release / reduce ops into the graphs.

- :func:`insert_gathers_pass` runs on the dynamo graph, before AOTAutograd: every use of a gathered
  ZeRO-3 parameter input goes through ``gather_param``, so both the forward and the recomputed backward see an
  explicit gather (the op's autograd formula passes the gradient through to the parameter input).
- :func:`fold_downcasts_pass` folds a downcast whose only input is a gathered parameter into the gather
  (the shard is cast before it is sent).
- :func:`insert_releases_pass` frees each gathered parameter right after its last real use, seeing through
  aliases; a gathered value that escapes the graph (saved for backward by a non-min-cut partition) is released
  by the graph that consumes it last.
- :func:`insert_reduces_pass` (backward) reduce-scatters each parameter gradient where it is produced and
  returns ``None`` in its place, so autograd never accumulates a full-size gradient; for inductor,
  :func:`defer_reduces_pass` moves each down past the fusible code after it; at ZeRO-1/2,
  :func:`fuse_matmul_reduces_pass` has the runtime compute a matmul's gradient where it is reduced.
"""
from typing import Dict, List, Optional, Set

import torch
from torch.fx import GraphModule, Node

from ..runtime.ops import GATHER, PARAM_GRAD, RELEASE, REDUCE, REDUCE_MM, encode_plan
from .nodes import (META_DS_ID, alias_closure, alias_source, downcast_dtype, gather_args, gather_dtype, is_gather,
                    is_reduce, is_reduce_mm, is_release, joint_primals, matmul_behind, output_args, output_node,
                    placeholders, reader_outputs, set_gather_args, size_hint, storage_root)

# Set on a forward output node / backward placeholder: the ds_id of the gathered parameter it aliases.
META_ESCAPED_DS_ID = "dsc_escaped_ds_id"


def insert_gathers_pass(gm: GraphModule, *, runtime_id: int, gathered_ds_ids: Dict[int, int]) -> GraphModule:
    """``gathered_ds_ids`` maps a placeholder index to the ds_id of the partitioned parameter it receives."""
    graph = gm.graph
    for index, node in enumerate(placeholders(graph)):
        ds_id = gathered_ds_ids.get(index)
        # a graph that only hands a parameter back (dynamo compiles e.g. a ``next(self.parameters())`` helper)
        # returns the Parameter itself, as eager code would: a gathered copy there would escape the graph
        if ds_id is None or not any(user.op != "output" for user in node.users):
            continue
        node.meta[META_DS_ID] = ds_id
        with graph.inserting_after(node):
            gathered = graph.call_function(GATHER, (node, runtime_id, ds_id, None, [], ""))
        node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered and user.op != "output")
        gathered.meta[META_DS_ID] = ds_id
    return gm


def _set_val(node: Node) -> None:
    """Refresh ``meta['val']`` of a gather after its dtype changed (the fake impl gives the full shape)."""
    val = node.meta.get("val")
    dtype = gather_dtype(node)
    if isinstance(val, torch.Tensor) and dtype is not None:
        node.meta["val"] = val.to(dtype)


def fold_downcasts_pass(gm: GraphModule) -> GraphModule:
    """``gather(p)`` whose every user is the same downcast becomes ``gather(p, dtype=...)``. Autocast casts the
    weight itself (then views it), which is this pattern; a cast behind a view is left as it is."""
    for node in list(gm.graph.nodes):
        if not is_gather(node) or gather_dtype(node) is not None or not node.users:
            continue
        dtypes = {downcast_dtype(user) for user in node.users}
        if len(dtypes) != 1 or None in dtypes:
            continue
        dtype = dtypes.pop()
        set_gather_args(node, dtype=dtype)
        _set_val(node)
        for cast in list(node.users):
            cast.replace_all_uses_with(node)
            gm.graph.erase_node(cast)
    return gm


def insert_releases_pass(gm: GraphModule, *, runtime_id: int) -> GraphModule:
    """Release after the last use of every gathered parameter (gathers, and escaped values coming in)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    out_node = output_node(graph)
    roots: List[Node] = [n for n in graph.nodes if is_gather(n) or (n.op == "placeholder" and META_ESCAPED_DS_ID in n.meta)]
    for root in roots:
        ds_id = root.args[2] if is_gather(root) else root.meta[META_ESCAPED_DS_ID]
        aliases = alias_closure(root)
        if out_node in {u for a in aliases for u in a.users}:
            # escapes (saved for backward or returned): the consumer releases it
            for value in output_args(graph):
                if isinstance(value, Node) and value in aliases:
                    value.meta[META_ESCAPED_DS_ID] = ds_id
            continue
        readers = reader_outputs(aliases)
        # after every alias, every reader and every value the release waits on
        after = max([*aliases, *readers, *(u for a in aliases for u in a.users if not is_release(u))],
                    key=order.__getitem__)
        with graph.inserting_after(after):
            graph.call_function(RELEASE, (root, runtime_id, ds_id, readers))
    return gm


def pin_gathers_pass(gm: GraphModule) -> GraphModule:
    """Make the scheduled position of each gather a data dependency: it waits for the closest earlier compute
    node's result, so a backend that reorders (inductor) cannot hoist every gather to the top again."""
    previous: Optional[Node] = None
    for node in gm.graph.nodes:
        if is_gather(node):
            if previous is not None:
                set_gather_args(node, after=[previous])
        elif (node.op == "call_function" and not is_release(node) and not is_reduce(node)
              and isinstance(node.meta.get("val"), torch.Tensor)):
            previous = node
    return gm


def chain_collectives_pass(gm: GraphModule) -> GraphModule:
    """Make the graph's order of its collective ops (gathers and reduces) a chain of data dependencies: each waits
    for the tensor of the one before it (a gather's result; a reduce's gradient, which the reduce mutates, so a later
    reader comes after it). Every rank must issue its collectives in one order. Inductor reorders ops that do not
    depend on each other (for peak memory, and as fusion moves nodes), by rules that depend on the shapes: ranks fed
    different lengths compile different shapes, and without the chain their reduces came out in different orders
    (a reduce-scatter of one rank met another's of a different size). For inductor's final graphs only: in graphs
    run as Python the order is the graph's anyway, and the chain would hold each gradient until the next
    collective."""
    token: Optional[Node] = None
    for node in gm.graph.nodes:
        if is_gather(node):
            after = list(gather_args(node)["after"])
            if token is not None and token not in after:
                set_gather_args(node, after=after + [token])
            token = node
        elif is_reduce(node) or is_reduce_mm(node):
            *inputs, after = node.args
            if token is not None and token not in after:
                node.args = (*inputs, list(after) + [token])
            token = inputs[0] if is_reduce(node) else node  # a fused reduce's token result
    gm.graph.lint()
    return gm


# Ops inductor runs as calls of their own (extern kernels), never fused with the pointwise and reduction code
# around them: a reduce moved down to one of these splits no fused kernel.
_EXTERN_KERNEL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution",
                                "aten::convolution_backward"})
_EXTERN_KERNEL_PREFIXES = ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention")


def _is_extern_kernel(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and (schema.name in _EXTERN_KERNEL_OPS or schema.name.startswith(_EXTERN_KERNEL_PREFIXES))


def retarget_calls_pass(gm: GraphModule, *, targets: Dict) -> GraphModule:
    """Each call of an op in ``targets`` calls what it maps to instead (the same schema and function without the
    layers tracing needs): the last pass before a backend runs the graph."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.target = targets[node.target]
    return gm


def defer_reduces_pass(gm: GraphModule) -> GraphModule:
    """For inductor: move each reduce down past the fusible code after its gradient, to just before the next op
    inductor calls as a kernel of its own (a matmul, attention, a convolution), the next gather or release, the
    first other reader of its gradient, or the output. A reduce is a call inductor cannot fuse across: placed where
    its gradient is produced, it splits a backward's fused kernels. A norm weight's gradient (a sum over the
    tokens) comes out of the middle of the norm's backward, and the norm's input-gradient kernel, which reads the
    same tensors, was then generated as a second kernel reading them again (the benchmark Llama's ZeRO-2
    backward: 15 kernels more than plain ``torch.compile``'s, one per norm). Moved past them, the gradient is
    held only as long as that fused code runs. The reduces keep their order among themselves and among the
    gathers and releases, so every rank issues the same collectives in the same order, and the arithmetic is
    unchanged."""
    graph = gm.graph
    pending: List[Node] = []
    grads: Set[Node] = set()  # the storage of each pending reduce's gradient, which the reduce consumes
    for node in list(graph.nodes):
        if is_reduce(node):
            pending.append(node)
            grads.add(storage_root(node.args[0]))
            continue
        if not pending:
            continue
        barrier = (node.op == "output" or is_gather(node) or is_release(node) or _is_extern_kernel(node)
                   or any(storage_root(i) in grads for i in node.all_input_nodes))
        if barrier:
            for reduce in pending:
                node.prepend(reduce)
            pending, grads = [], set()
    graph.lint()
    return gm


def fuse_matmul_reduces_pass(gm: GraphModule) -> GraphModule:
    """Each reduce whose gradient is a matmul's result as it is, read by nothing else (a linear layer's weight
    gradient: :func:`nodes.matmul_behind`), becomes one ``reduce_grad_mm``, and the matmul and its views go: the
    runtime computes the product where the gradient goes (ZeRO-2's reduce bucket) instead of the graph computing it
    into a buffer of its own that is then copied there, and skips it where autograd does not want the gradient
    (``ops.reduce_grad_mm``). It takes the matmul's place where no other collective op lies between the two (so its
    operands are freed as early as before: the matmul is a kernel of its own in every backend), else the reduce's,
    which keeps the collectives' order; the product is the same kernel's on the same operands. For the final graphs of
    ZeRO-1/2, after every pass that reads the reduces, before the collectives are chained."""
    graph = gm.graph
    for node in [n for n in graph.nodes if is_reduce(n)]:
        grad = node.args[0]
        mm = matmul_behind(grad) if isinstance(grad, Node) else None
        if mm is None:
            continue
        stay = bool(node.args[-1])  # already chained to the collective before it
        cursor = mm.next
        while not stay and cursor is not node:
            stay = is_gather(cursor) or is_release(cursor) or is_reduce(cursor) or is_reduce_mm(cursor)
            cursor = cursor.next
        with graph.inserting_before(node if stay else mm):
            fused = graph.call_function(REDUCE_MM, (*mm.args, *node.args[1:]))
        fused.meta["val"] = mm.meta["val"].new_empty(0)
        graph.erase_node(node)
        while grad is not mm:  # the views, then the matmul
            inner = alias_source(grad)
            graph.erase_node(grad)
            grad = inner
        graph.erase_node(mm)
    graph.lint()
    return gm


def coalesce_gathers_pass(gm: GraphModule, *, bucket_numel: int) -> GraphModule:
    """Group the scheduled gathers into runs and gather each run in one collective, as eager ZeRO-3 prefetches up to
    ``stage3_prefetch_bucket_size``: walking the gathers in schedule order, a run takes the following gathers while it
    stays within ``bucket_numel`` elements and holds no parameter twice (members of several gather dtypes, as under
    autocast, go out as one collective per dtype). Its later gathers move
    up to its first (so a parameter may be gathered up to one bucket before its first use), then ``pin_gathers_pass``
    makes those positions data dependencies. The first gather of each run carries the run and the next one
    (``ops.encode_plan``): it gathers the whole run in one collective, waiting only for what is not already in
    flight, and starts the next run's collective asynchronously, so one run is always in flight ahead of use. The memory plan counts all of it (``schedule/memory_plan.in_flight_storages``)."""
    runs: List[List[Node]] = []
    numel = 0
    members: Set[int] = set()  # ds_ids in the current run
    for node in [n for n in gm.graph.nodes if is_gather(n)]:
        size = _numel(node)
        if not runs or numel + size > bucket_numel or node.args[2] in members:
            runs.append([node])
            numel, members = size, {node.args[2]}
            continue
        runs[-1][-1].append(node)  # moves the gather up, right behind the run's previous one
        runs[-1].append(node)
        numel += size
        members.add(node.args[2])
    members = [[(g.args[2], gather_dtype(g)) for g in run] for run in runs] + [[]]
    for i, run in enumerate(runs):
        set_gather_args(run[0], plan=encode_plan(members[i], members[i + 1]))
    return gm


def _numel(gather: Node) -> int:
    val = gather.meta.get("val")
    return size_hint(val.numel()) if isinstance(val, torch.Tensor) else 0


def mark_param_grads_pass(joint: GraphModule, *, num_fwd_outputs: int, grad_inputs: List[int]) -> GraphModule:
    """ZeRO-1/2 joint graph: the gradient of each primal in ``grad_inputs`` (a replicated trained parameter) becomes
    ``param_grad(grad, primal)``, as a gathered parameter's does through the gather's autograd formula. The partition
    then hands the parameter itself to backward (a reference, no copy) and its reduce names it there, so the graph
    serves any module of the same code, each call on its own parameters."""
    graph = joint.graph
    primals = joint_primals(graph)
    out_node = output_node(graph)
    outputs = output_args(graph)
    for i in grad_inputs:
        grad = outputs[num_fwd_outputs + i]
        if not isinstance(grad, Node):
            continue
        with graph.inserting_before(out_node):
            marked = graph.call_function(PARAM_GRAD, (grad, primals[i]))
        marked.meta.update(grad.meta)
        outputs[num_fwd_outputs + i] = marked
    out_node.args = (type(out_node.args[0])(outputs),)
    joint.recompile()
    return joint


def insert_reduces_pass(gm: GraphModule, *, runtime_id: int, grad_ds_ids: List[Optional[int]]) -> GraphModule:
    """``grad_ds_ids[i]``: the ds_id (ZeRO-1/2: the runtime's key) whose gradient is backward output ``i`` (None
    for other inputs). A gathered parameter's gradient comes out of ``param_grad(grad, stand-in)`` (the gather's
    autograd formula): its reduce is handed the stand-in, by which the runtime finds the parameter at run time."""
    graph = gm.graph
    out_node = output_node(graph)
    outputs = output_args(graph)
    if len(outputs) < len(grad_ds_ids):
        raise AssertionError(f"backward graph has {len(outputs)} outputs, expected >= {len(grad_ds_ids)}")
    last_placeholder = placeholders(graph)[-1]
    for i, ds_id in enumerate(grad_ds_ids):
        grad = outputs[i]
        if ds_id is None or not isinstance(grad, Node):
            continue
        param = None
        if grad.op == "call_function" and grad.target is PARAM_GRAD:
            grad, param = grad.args
        # as soon as the gradient exists: its reduce-scatter overlaps the rest of backward
        with graph.inserting_after(last_placeholder if grad.op == "placeholder" else grad):
            graph.call_function(REDUCE, (grad, runtime_id, ds_id, param, []))
        outputs[i] = None
    out_node.args = (tuple(outputs),)
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is PARAM_GRAD]:
        if node.users:
            raise AssertionError(f"deepspeed-compile: a parameter gradient ({node.name}) is used in the backward "
                                 "graph other than as its output")
        graph.erase_node(node)
    return gm


def escaped_saved_names(fw: GraphModule) -> Dict[str, int]:
    """Names of forward outputs marked as escaped gathered parameters, with their ds_id."""
    return {n.name: n.meta[META_ESCAPED_DS_ID] for n in output_args(fw.graph)
            if isinstance(n, Node) and META_ESCAPED_DS_ID in n.meta}


def mark_escaped_inputs(bw: GraphModule, escaped: Dict[str, int]) -> Set[str]:
    """Mark backward placeholders that receive an escaped gathered parameter saved by the forward."""
    marked = set()
    for node in placeholders(bw.graph):
        if node.name in escaped:
            node.meta[META_ESCAPED_DS_ID] = escaped[node.name]
            marked.add(node.name)
    return marked

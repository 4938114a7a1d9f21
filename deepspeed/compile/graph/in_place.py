# SPDX-License-Identifier: Apache-2.0
"""The eager backend's sums written into an operand that dies there, and gradients reduced where they lie.

AOTAutograd's graphs are functional: ``aten.add.Tensor`` always returns a new tensor. Inductor reuses a dead input's
buffer for it; the eager backend runs the graph op by op, so every sum allocates, and a large one pays for fresh
pages. The largest is a tied weight's gradient (GPT-2's token embedding and head): the head's matmul gradient plus
the embedding's, two vocabulary-by-width tensors, summed into a third at the end of backward. Written into the
operand that dies at the sum, it takes neither the allocation nor its page faults, and the peak is one such tensor
lower. ``a + b`` rounds as ``b + a``, so the sum is the same bit for bit whichever operand receives it. That sum is
then read by its reduce alone, which may reduce it where it lies instead of copying it into a bucket of its own
(:func:`owned_reduces_pass`).
"""
import torch
from torch.fx import GraphModule, Node

from ..runtime.ops import run_reduce_owned
from .nodes import alias_source, is_reduce

_ADD = torch.ops.aten.add.Tensor
_ADD_ = torch.ops.aten.add_.Tensor


def _plain_layout(value) -> bool:
    return (isinstance(value, torch.Tensor) and all(isinstance(s, int) for s in value.shape)
            and all(isinstance(s, int) for s in value.stride()))


def _receives(operand, node: Node) -> bool:
    """Whether ``node``'s sum may be written into ``operand``: a tensor an ATen op made fresh (its schema says its
    result aliases no input), read by nothing else (so no view of it lives either), with the sum's dtype and shape,
    and its strides too unless only gradient reduces read the sum (they take any layout: a tied weight's head
    gradient is often a transposed matmul, the sum then the transpose's layout, the embedding's gradient not)."""
    # read by nothing but the sum, and (not a view) the storage's own tensor; not our ops: a gather's result is the
    # runtime's buffer
    if not _owned(operand, node) or alias_source(operand) is not None:
        return False
    mine, result = operand.meta.get("val"), node.meta.get("val")
    if not (_plain_layout(mine) and _plain_layout(result) and mine.dtype == result.dtype
            and mine.shape == result.shape):
        return False
    return mine.stride() == result.stride() or (mine.is_contiguous() and all(map(is_reduce, node.users)))


def in_place_sums_pass(gm: GraphModule) -> int:
    """Rewrite each ``aten.add.Tensor`` one of whose operands may receive it (:func:`_receives`) as ``add_`` into
    that operand. A scaled sum (``alpha``) keeps its order, so only its first operand may receive it. Returns how
    many sums were rewritten."""
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _ADD or len(node.args) != 2:
            continue
        first, second = node.args
        scaled = node.kwargs.get("alpha", 1) != 1
        if _receives(first, node):
            node.args = (first, second)
        elif not scaled and _receives(second, node):
            node.args = (second, first)
        else:
            continue
        node.target = _ADD_
        rewritten += 1
    return rewritten


def _owned(grad, reduce: Node) -> bool:
    """Whether nothing but ``reduce`` reads ``grad``'s storage: ``grad`` and every alias between it and the fresh ATen
    result whose storage it is (the ``add_`` of :func:`in_place_sums_pass`, a view) each read by the next alone."""
    node, reader = grad, reduce
    while isinstance(node, Node) and node.op == "call_function" and list(node.users) == [reader] \
            and type(node.target) is torch._ops.OpOverload and node.target.namespace == "aten":
        source = alias_source(node)
        if source is None:
            return True
        node, reader = source, node
    return False


def owned_reduces_pass(gm: GraphModule) -> int:
    """Each gradient reduce whose gradient's storage nothing else reads (:func:`_owned`) calls
    ``ops.run_reduce_owned``: the runtime may reduce that gradient where it lies instead of copying it into a bucket
    first. The eager backend's last pass before our ops are called as plain functions. Returns how many."""
    owned = 0
    for node in gm.graph.nodes:
        if is_reduce(node) and _owned(node.args[0], node):
            node.target = run_reduce_owned
            owned += 1
    return owned

# SPDX-License-Identifier: Apache-2.0
"""The per-op tables of the sequence rewrite (``graph/sequence.py``): which rule each op of a dynamo graph gets, and,
for the per-position ops, which dimensions of an input they read across positions (reduce, normalize, contract or
index along). A per-position rule keeps a block only where the block's dimension is not one of them: a softmax over
the sequence normalizes over the whole sequence, which one rank's block does not hold.
"""
import operator
from typing import Any, Callable, Dict, FrozenSet, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import Node

ELEMENTWISE_FUNCS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
                     operator.and_, operator.or_, operator.invert, torch.add, torch.sub, torch.mul, torch.div,
                     torch.rsqrt, torch.sqrt, torch.tanh, torch.sigmoid, torch.exp, torch.pow, torch.sin, torch.cos,
                     torch.where, torch.erf, torch.abs, torch.neg, F.silu, F.gelu, F.relu, F.dropout, F.tanh,
                     torch.nn.functional.sigmoid, torch.masked_fill}
ELEMENTWISE_METHODS = {"to", "float", "half", "bfloat16", "double", "type_as", "contiguous", "pow", "__neg__", "neg",
                       "mul", "add", "sub", "div", "rsqrt", "sqrt", "tanh", "sigmoid", "exp", "sin", "cos", "abs",
                       "masked_fill", "clone", "detach", "__and__", "__or__", "__invert__", "float", "long", "int",
                       "bool", "sigmoid"}
VIEW_FUNCS = {torch.reshape, torch.unsqueeze, torch.squeeze, torch.flatten, operator.getitem}
VIEW_METHODS = {"view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "view_as"}
SPLIT = {torch.split, torch.chunk, "split", "chunk"}
PERMUTE = {torch.transpose, torch.permute, "transpose", "permute"}
ATTENTION = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
LOSSES = {F.cross_entropy, F.nll_loss}
FULL_RESULT_METHODS = {"new_ones", "new_zeros", "new_empty", "new_full", "new_tensor", "dim"}  # metadata only
# higher-order ops that call a body graph (a ``get_attr`` of a GraphModule) on the operands after it, once, as it is:
# activation checkpointing (``torch.utils.checkpoint``, Hugging Face's gradient checkpointing), and the regions dynamo
# wraps for an autocast or a grad mode entered inside the compiled code
BODY_CALLS = {"tag_activation_checkpoint", "wrap", "wrap_with_autocast", "wrap_with_set_grad_enabled"}

Dims = FrozenSet[int]
ALL: Dims = frozenset(range(64))  # every dimension: a reduction over all of them, or an input read as a whole
Position = Union[int, str]  # an argument's index in ``node.args``, or its keyword


def _dims(dim: Any, ndim: int) -> Dims:
    """The dimensions a ``dim`` argument names; every one for None or an empty list (torch's "all"), or a value the
    graph computes."""
    if isinstance(dim, int):
        return frozenset({dim % ndim})
    if isinstance(dim, (tuple, list)) and dim and all(isinstance(d, int) for d in dim):
        return frozenset(d % ndim for d in dim)
    return ALL


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    return node.kwargs.get(name, node.args[index] if len(node.args) > index else default)


def _along_dim(index: int, default: Any = None) -> Callable[[Node, Position, int], Dims]:
    """An op of its input along its ``dim`` argument (at ``index``)."""
    def read(node: Node, position: Position, ndim: int) -> Dims:
        return _dims(_arg(node, index, "dim", default), ndim) if position in (0, "input") else ALL
    return read


def _normalized(node: Node, position: Position, ndim: int) -> Dims:
    """``layer_norm`` / ``rms_norm``: the input's last ``len(normalized_shape)`` dimensions; weight and bias whole."""
    if position not in (0, "input"):
        return ALL
    shape = _arg(node, 1, "normalized_shape")
    if isinstance(shape, Node):  # a shape the graph computes (``x.shape[1:]``): its traced value
        shape = shape.meta.get("example_value", shape.meta.get("val"))
    if isinstance(shape, int):
        return frozenset({ndim - 1})
    return frozenset(range(ndim - len(shape), ndim)) if isinstance(shape, (tuple, list)) else ALL


def _linear(node: Node, position: Position, ndim: int) -> Dims:
    """``linear``: the input's features (its last dimension); the weight and bias whole."""
    return frozenset({ndim - 1}) if position in (0, "input") else ALL


def _matmul(first: int) -> Callable[[Node, Position, int], Dims]:
    """A matrix product of the arguments at ``first`` and ``first + 1``: the first's last dimension and the second's
    rows (its second to last, or its only one) are contracted; any other argument (``addmm``'s bias) is read whole."""
    def read(node: Node, position: Position, ndim: int) -> Dims:
        if position == first:
            return frozenset({ndim - 1})
        if position == first + 1:
            return frozenset({ndim - 2 if ndim >= 2 else 0})
        return ALL
    return read


def _embedding(node: Node, position: Position, ndim: int) -> Dims:
    """``embedding``: each index picks a row of the table, which is read whole."""
    return frozenset() if position in (0, "input") else ALL


# the per-position ops: one output position per input position, reading the dimensions given here across positions
PER_POSITION_FUNCS: Dict[Any, Callable[[Node, Position, int], Dims]] = {
    torch._C._nn.linear: _linear, F.linear: _linear, torch.addmm: _matmul(1), torch.mm: _matmul(0),
    torch.matmul: _matmul(0), F.layer_norm: _normalized, F.rms_norm: _normalized, F.embedding: _embedding,
    F.softmax: _along_dim(1), F.log_softmax: _along_dim(1), torch.softmax: _along_dim(1),
    torch.log_softmax: _along_dim(1), torch.mean: _along_dim(1), torch.sum: _along_dim(1)}
PER_POSITION_METHODS: Dict[str, Callable[[Node, Position, int], Dims]] = {
    "mean": _along_dim(1), "sum": _along_dim(1), "softmax": _along_dim(1), "log_softmax": _along_dim(1),
    "matmul": _matmul(0), "amax": _along_dim(1, ()), "norm": _along_dim(2)}


def per_position_reads(node: Node) -> Optional[Callable[[Node, Position, int], Dims]]:
    """What a per-position op reads across positions, or None where ``node`` is no per-position op."""
    if node.op == "call_method":
        return PER_POSITION_METHODS.get(node.target)
    return PER_POSITION_FUNCS.get(node.target) if node.op == "call_function" else None


def position_of(node: Node, arg: Node) -> Optional[Position]:
    """Where ``arg`` is passed to ``node``: its index in the arguments, or its keyword."""
    for index, value in enumerate(node.args):
        if value is arg:
            return index
    return next((name for name, value in node.kwargs.items() if value is arg), None)


def op_name(node: Node) -> str:
    """A short name of the op ``node`` calls, for the report and the warnings."""
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", None) or getattr(target, "_name", None) or str(target)


def body_call(node: Node) -> Optional[int]:
    """Where a call of a body graph (:data:`BODY_CALLS`) has its body: the index of the ``get_attr`` argument."""
    if node.op != "call_function" or getattr(node.target, "_name", None) not in BODY_CALLS:
        return None
    return next((i for i, arg in enumerate(node.args) if isinstance(arg, Node) and arg.op == "get_attr"), None)

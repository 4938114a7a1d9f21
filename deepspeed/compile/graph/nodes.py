"""Small analysis helpers over aten-level FX graphs: aliases, downcasts, parameter-derived nodes.

Shared vocabulary of the passes: a node *aliases* its input when the op's schema says its output is a view
of an input (views, ``t``, ``expand``, ``split`` and the ``getitem`` after it, ...); a *downcast* is a
``convert_element_type`` / ``_to_copy`` to a narrower floating dtype. A node is *parameter-derived* when it
reaches a parameter (a parameter primal or a gather of one) only through aliases and downcasts.
"""
import operator
from typing import Iterable, List, Optional, Set

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import optimization_hint

from ..runtime.ops import GATHER, RELEASE, REDUCE

# Ops whose result shares storage with their first argument without declaring it in the schema.
UNDECLARED_ALIAS_OPS = (torch.ops.aten._unsafe_view.default, )

# node.meta keys the passes communicate through.
META_DS_ID = "dsc_ds_id"  # on parameter primals / gathers: the ZeRO-3 ds_id


def is_gather(node: Node) -> bool:
    return node.op == "call_function" and node.target is GATHER


def gather_dtype(node: Node) -> Optional[torch.dtype]:
    """The ``dtype=`` of a gather node (AOTAutograd may drop a default argument or pass it by keyword)."""
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("dtype")


def is_release(node: Node) -> bool:
    return node.op == "call_function" and node.target is RELEASE


def is_reduce(node: Node) -> bool:
    return node.op == "call_function" and node.target is REDUCE


def is_alias(node: Node) -> bool:
    """True if ``node``'s output shares storage with its first tensor input (no copy is made)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, Node) and is_alias(src)
    if node.target in UNDECLARED_ALIAS_OPS:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    # Covers list-returning views too (split, unbind: ``Tensor(a)[]``); in-place ops are ``is_write``.
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


def downcast_dtype(node: Node) -> Optional[torch.dtype]:
    """The target dtype if ``node`` casts a floating tensor to a narrower floating dtype (same device)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return None
    if node.target is torch.ops.prims.convert_element_type.default:
        dtype = node.args[1]
    elif node.target is torch.ops.aten._to_copy.default and set(node.kwargs) <= {"dtype"}:
        dtype = node.kwargs.get("dtype")
    else:
        return None
    src = node.args[0].meta.get("val")
    if not isinstance(dtype, torch.dtype) or not isinstance(src, torch.Tensor):
        return None
    if src.dtype.is_floating_point and dtype.is_floating_point and dtype.itemsize < src.dtype.itemsize:
        return dtype
    return None


def derived_closure(roots: Iterable[Node], through_casts: bool = True) -> Set[Node]:
    """``roots`` plus every node that reaches one of them only through aliases (and downcasts)."""
    found: Set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        for user in node.users:
            if is_alias(user) or is_gather(user) or (through_casts and downcast_dtype(user) is not None):
                stack.append(user)
    return found


def alias_closure(root: Node) -> Set[Node]:
    """``root`` and every node that shares its storage through a chain of aliases."""
    return derived_closure([root], through_casts=False)


def reader_outputs(nodes: Set[Node]) -> List[Node]:
    """A tensor-valued node for each reader of ``nodes`` (readers outside the set, not releases): the values a
    release must wait for. A multi-output reader is represented by one of its ``getitem`` results."""
    readers: List[Node] = []
    for reader in sorted({u for n in nodes for u in n.users if u not in nodes and not is_release(u)},
                         key=lambda n: n.name):
        val = reader.meta.get("val")
        if isinstance(val, torch.Tensor):
            readers.append(reader)
        elif isinstance(val, (tuple, list)):
            items = [u for u in reader.users if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor)]
            if items:
                readers.append(min(items, key=lambda n: n.name))
    return readers


def placeholders(graph: Graph) -> List[Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def output_args(graph: Graph) -> List:
    out = graph.output_node() if hasattr(graph, "output_node") else next(n for n in graph.nodes if n.op == "output")
    args = out.args[0]
    return list(args) if isinstance(args, (list, tuple)) else [args]


def size_hint(size) -> int:
    """An int for a size that may be symbolic (dynamic shapes): its hint, without adding a guard. Byte counts
    are for reports and the scheduler's memory plan; a guard here would specialize the graph to one shape."""
    return optimization_hint(size, fallback=8192)


def tensor_bytes(node: Node) -> int:
    """Bytes of storage a node's value needs (a stride-0 stand-in needs one element)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    sizes = [size_hint(s) for s in val.shape]
    if 0 in sizes:
        return 0
    span = 1 + sum((size - 1) * size_hint(stride) for size, stride in zip(sizes, val.stride()))
    return span * val.element_size()

# SPDX-License-Identifier: Apache-2.0
"""Small analysis helpers over aten-level FX graphs: aliases, downcasts, parameter-derived nodes.

The one vocabulary of the package: a node *aliases* an input when its result shares that input's storage, as the
op's schema says (views, ``t``, ``expand``, ``split`` and the ``getitem`` after it, in-place results, ...); its
*storage root* is the node that owns that storage; its *bytes* are the storage its value spans (``tensor_bytes``);
a *downcast* is a
``convert_element_type`` / ``_to_copy`` to a narrower floating dtype. A node is *parameter-derived* when it
reaches a parameter (a parameter primal or a gather of one) only through aliases and downcasts.
"""
import operator
from typing import Dict, Iterable, List, Optional, Sequence, Set

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import optimization_hint

from ..runtime.ops import GATHER, RELEASE, REDUCE, REDUCE_MM

# Ops whose result shares storage with their first argument without declaring it in the schema.
UNDECLARED_ALIAS_OPS = (torch.ops.aten._unsafe_view.default, )

# node.meta keys the passes communicate through.
META_DS_ID = "dsc_ds_id"  # on parameter primals / gathers: the ZeRO-3 ds_id


def is_gather(node: Node) -> bool:
    return node.op == "call_function" and node.target is GATHER


# gather_param's arguments, in order, as its schema names them (``runtime/ops.py``)
GATHER_FIELDS = tuple(argument.name for argument in GATHER._schema.arguments)
_GATHER_DEFAULTS = {"dtype": None, "after": (), "plan": ""}


def gather_args(node: Node) -> Dict[str, object]:
    """A gather node's arguments by name, whether positional or by keyword (AOTAutograd passes some by keyword)."""
    values = dict(_GATHER_DEFAULTS)
    values.update(zip(GATHER_FIELDS, node.args))
    values.update(node.kwargs)
    return values


def set_gather_args(node: Node, **changes) -> None:
    """Change some of a gather node's arguments; all are then positional."""
    values = {**gather_args(node), **changes}
    node.args = tuple(list(values[f]) if f == "after" else values[f] for f in GATHER_FIELDS)
    node.kwargs = {}


def gather_dtype(node: Node) -> Optional[torch.dtype]:
    """The ``dtype=`` of a gather node."""
    return gather_args(node)["dtype"]


def gather_plan(node: Node) -> str:
    """The ``plan=`` of a gather node: the run of coalesced gathers it starts (``ops.encode_plan``), or empty."""
    return gather_args(node)["plan"]


def gather_runs(nodes: Iterable[Node]) -> List[List[Node]]:
    """The runs of coalesced gathers in graph order (``coalesce_gathers_pass``): a gather with a plan starts a
    run, the gathers without one after it belong to it. None in a graph that was not coalesced."""
    runs: List[List[Node]] = []
    for node in nodes:
        if is_gather(node):
            if gather_plan(node):
                runs.append([node])
            elif runs:
                runs[-1].append(node)
    return runs


def is_release(node: Node) -> bool:
    return node.op == "call_function" and node.target is RELEASE


def is_reduce(node: Node) -> bool:
    return node.op == "call_function" and node.target is REDUCE


def is_reduce_mm(node: Node) -> bool:
    """A reduce fused with the matmul that computes its gradient (``rewrite.fuse_matmul_reduces_pass``)."""
    return node.op == "call_function" and node.target is REDUCE_MM


def _arg_value(node: Node, index: int, name: str):
    return node.args[index] if index < len(node.args) else node.kwargs.get(name)


def alias_source(node: Node) -> Optional[Node]:
    """The input whose storage ``node``'s result shares, or None: views (``view``, ``t``, ``expand``, ...), the
    elements of list-returning views (``split``/``unbind`` and the ``getitem`` after them), in-place results, and
    ops that alias without saying so in their schema. Read from the op schemas, never from a list of names."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        source = node.args[0]
        return alias_source(source) if isinstance(source, Node) else None
    if node.target in UNDECLARED_ALIAS_OPS:
        first = node.args[0] if node.args else None
        return first if isinstance(first, Node) else None
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for ret in schema.returns:
        if ret.alias_info is None:
            continue
        # a list of views (``Tensor(a)[]``) carries its alias set on the elements: it aliases the argument whose
        # set widens to the wildcard (``Tensor(a -> *) self``)
        shared = ret.alias_info.before_set
        for index, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is not None and (shared & info.before_set or not shared and "*" in info.after_set):
                value = _arg_value(node, index, arg.name)
                if isinstance(value, Node):
                    return value
    return None


def is_alias(node: Node) -> bool:
    """True if ``node``'s result shares storage with one of its inputs (no copy is made)."""
    return alias_source(node) is not None


def storage_root(node: Node) -> Node:
    """The node that owns the storage ``node``'s value lives in (itself unless it is an alias)."""
    source = alias_source(node)
    while source is not None:
        node, source = source, alias_source(source)
    return node


def storage_roots(nodes: Sequence[Node]) -> Dict[Node, Node]:
    """:func:`storage_root` of each node of a topologically ordered sequence, in one pass."""
    roots: Dict[Node, Node] = {}
    for node in nodes:
        source = alias_source(node)
        roots[node] = roots.get(source, source) if source is not None else node
    return roots


def mutated_inputs(node: Node) -> List[Node]:
    """Inputs that ``node`` writes to (``Tensor(a!)`` in its schema): ``release_param`` and ``reduce_grad`` among
    them."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    found = []
    for index, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = _arg_value(node, index, arg.name)
            if isinstance(value, Node):
                found.append(value)
    return found


def matmul_behind(node: Node) -> Optional[Node]:
    """The ``aten.mm`` node whose result ``node`` is, as it is: the matmul itself, or views of it (read-only
    aliases, such as the two transposes AOTAutograd leaves on a linear layer's weight gradient) that come back to
    its own shape and strides; the matmul and each view read by nothing else. None otherwise."""
    val = node.meta.get("val")
    source = node
    while source.op == "call_function" and source.target is not torch.ops.aten.mm.default:
        inner = alias_source(source)
        if inner is None or source.target is operator.getitem or mutated_inputs(source) or len(inner.users) != 1:
            return None
        source = inner
    if source.op != "call_function" or source.kwargs or len(source.users) != 1:
        return None
    mm = source.meta.get("val")
    same = (isinstance(val, torch.Tensor) and isinstance(mm, torch.Tensor) and val.shape == mm.shape
            and val.stride() == mm.stride() and val.storage_offset() == mm.storage_offset())
    return source if same else None


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
            if _shares_storage_of(user, node) or is_gather(user) \
                    or (through_casts and downcast_dtype(user) is not None and user.args[0] is node):
                stack.append(user)
    return found


def _shares_storage_of(user: Node, node: Node) -> bool:
    """``user``'s result shares ``node``'s storage (an element of a list-returning view shares its input's)."""
    if user.target is operator.getitem:
        return user.args[0] is node and is_alias(user)
    return alias_source(user) is node


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


def joint_primals(graph: Graph) -> List[Node]:
    """A joint graph's inputs that are the forward's inputs (AOTAutograd names the others ``tangents_*``)."""
    return [n for n in placeholders(graph) if "tangents" not in n.name]


def param_primals(graph: Graph) -> Set[Node]:
    """Graph inputs that are ZeRO-3 parameters (marked with their ``ds_id``)."""
    return {n for n in placeholders(graph) if META_DS_ID in n.meta}


def output_node(graph: Graph) -> Node:
    return graph.output_node()


def output_args(graph: Graph) -> List:
    args = output_node(graph).args[0]
    return list(args) if isinstance(args, (list, tuple)) else [args]


def size_hint(size) -> int:
    """An int for a size that may be symbolic (dynamic shapes): its hint, without adding a guard. Byte counts
    are for reports and the scheduler's memory plan; a guard here would specialize the graph to one shape."""
    return optimization_hint(size, fallback=8192)


def tensor_bytes(node: Node) -> int:
    """Bytes of storage ``node``'s value spans: the one byte count of this package. A stride-0 stand-in spans one
    element; tuples count 0 (their ``getitem`` elements count). A gather inserted without metadata counts its
    stand-in's full shape in the gathered dtype."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        sizes = [size_hint(s) for s in val.shape]
        if 0 in sizes:
            return 0
        span = 1 + sum((size - 1) * size_hint(stride) for size, stride in zip(sizes, val.stride()))
        return span * val.element_size()
    if val is not None:
        return 0
    if is_gather(node) and isinstance(node.args[0], Node):
        standin = node.args[0].meta.get("val")
        if isinstance(standin, torch.Tensor):
            dtype = gather_dtype(node) or standin.dtype
            return size_hint(standin.numel()) * dtype.itemsize
    meta = node.meta.get("tensor_meta")  # traced by torch.fx's ShapeProp instead of make_fx
    if meta is not None and hasattr(meta, "shape"):
        numel = 1
        for size in meta.shape:
            numel *= size_hint(size)
        return numel * meta.dtype.itemsize
    return 0

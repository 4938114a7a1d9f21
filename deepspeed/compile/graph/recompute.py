"""Tag pass: before partitioning, mark every parameter alias and downcast ``MUST_RECOMPUTE``.

With these tags the min-cut partitioner can never save a gathered parameter, a view of it, or its autocast
copy for backward: backward recomputes them from the parameter input (a storage-less stand-in), which the
rewrite then turns into a fresh gather, with the downcast folded in.
"""
from typing import AbstractSet, Dict

from torch.fx import GraphModule
from torch.utils.checkpoint import CheckpointPolicy

from .nodes import META_DS_ID, derived_closure, is_gather, param_primals, size_hint

RECOMPUTE = "recompute"


def tag_param_aliases_pass(gm: GraphModule, *, keep: AbstractSet[int] = frozenset()) -> GraphModule:
    """Mark each node reached from a parameter primal only through gathers, aliases and downcasts, except for the
    parameters whose ds_id is in ``keep``: the partitioner may save those gathered for backward (see
    ``choose_kept_params``)."""
    primals = [n for n in param_primals(gm.graph) if n.meta[META_DS_ID] not in keep]
    for node in derived_closure(primals):
        if node.op == "call_function":
            node.meta[RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
    return gm


def choose_kept_params(gm: GraphModule, budget_bytes: int) -> Dict[int, int]:
    """Parameters of a joint graph to keep gathered from forward to backward, within ``budget_bytes``: the last
    gathered in forward first, since backward needs them first (they stay gathered the shortest time). Sizes are the
    gathered parameter in its own dtype (an upper bound when autocast saves a narrower copy)."""
    first_use: Dict[int, int] = {}
    sizes: Dict[int, int] = {}
    for index, node in enumerate(gm.graph.nodes):
        if is_gather(node) and node.args[2] not in first_use:
            val = node.meta.get("val")
            if val is None:
                continue
            first_use[node.args[2]] = index
            sizes[node.args[2]] = size_hint(val.numel()) * val.element_size()
    kept: Dict[int, int] = {}  # ds_id -> bytes
    for ds_id in sorted(first_use, key=first_use.__getitem__, reverse=True):
        if sizes[ds_id] <= budget_bytes:
            kept[ds_id] = sizes[ds_id]
            budget_bytes -= sizes[ds_id]
    return kept

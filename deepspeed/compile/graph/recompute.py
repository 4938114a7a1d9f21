"""Tag pass: before partitioning, mark every parameter alias and downcast ``MUST_RECOMPUTE``.

With these tags the min-cut partitioner can never save a gathered parameter, a view of it, or its autocast
copy for backward: backward recomputes them from the parameter input (a storage-less stand-in), which the
rewrite then turns into a fresh gather, with the downcast folded in.
"""
from typing import Set

from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from .nodes import META_DS_ID, derived_closure, placeholders

RECOMPUTE = "recompute"


def param_primals(gm: GraphModule) -> Set[Node]:
    return {n for n in placeholders(gm.graph) if META_DS_ID in n.meta}


def tag_param_aliases_pass(gm: GraphModule) -> GraphModule:
    """Mark each node reached from a parameter primal only through gathers, aliases and downcasts."""
    for node in derived_closure(param_primals(gm)):
        if node.op == "call_function":
            node.meta[RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
    return gm

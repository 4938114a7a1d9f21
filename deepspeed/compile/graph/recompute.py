"""Tag pass: before partitioning, mark every parameter alias and downcast ``MUST_RECOMPUTE``.

With these tags the min-cut partitioner can never save a gathered parameter, a view of it, or its autocast
copy for backward: backward recomputes them from the parameter input (a storage-less stand-in), which the
rewrite then turns into a fresh gather, with the downcast folded in.
"""
from torch.fx import GraphModule
from torch.utils.checkpoint import CheckpointPolicy

from .nodes import derived_closure, param_primals

RECOMPUTE = "recompute"


def tag_param_aliases_pass(gm: GraphModule) -> GraphModule:
    """Mark each node reached from a parameter primal only through gathers, aliases and downcasts."""
    for node in derived_closure(param_primals(gm.graph)):
        if node.op == "call_function":
            node.meta[RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
    return gm

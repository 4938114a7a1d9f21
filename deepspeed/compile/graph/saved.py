# SPDX-License-Identifier: Apache-2.0
"""Saved-for-backward report of a partitioned forward graph: bytes kept alive for backward, split into
parameter-derived (gathered parameters, their aliases and downcasts) and other (activations)."""
from dataclasses import dataclass
from typing import Set

from torch.fx import GraphModule, Node

from .nodes import derived_closure, is_gather, output_args, param_primals, storage_root, tensor_bytes


@dataclass
class SavedBytes:
    param_bytes: int = 0
    other_bytes: int = 0
    param_tensors: int = 0
    other_tensors: int = 0

    def __iadd__(self, other: "SavedBytes") -> "SavedBytes":
        self.param_bytes += other.param_bytes
        self.other_bytes += other.other_bytes
        self.param_tensors += other.param_tensors
        self.other_tensors += other.other_tensors
        return self


def saved_for_backward(fw: GraphModule, num_fwd_outputs: int) -> SavedBytes:
    """Count the storage that forward outputs ``num_fwd_outputs:`` (the saved values) keep alive. A saved
    alias of a graph input costs nothing; several aliases of one buffer count it once."""
    graph = fw.graph
    params = [*param_primals(graph), *(n for n in graph.nodes if is_gather(n))]
    param_derived = derived_closure(params)
    report = SavedBytes()
    seen: Set[Node] = set()
    for value in output_args(graph)[num_fwd_outputs:]:
        if not isinstance(value, Node):
            continue
        root = storage_root(value)
        if root.op == "placeholder" or root in seen:
            continue
        seen.add(root)
        nbytes = tensor_bytes(root)
        if nbytes == 0:
            continue
        if root in param_derived:
            report.param_bytes += nbytes
            report.param_tensors += 1
        else:
            report.other_bytes += nbytes
            report.other_tensors += 1
    return report

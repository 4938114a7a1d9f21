# SPDX-License-Identifier: Apache-2.0
"""Count all-gather and reduce-scatter bytes issued through ``torch.distributed`` (benchmark processes only).

Every Python-level collective of torch 2.13 (``all_gather_into_tensor``, ``_all_gather_base``,
``reduce_scatter_tensor``, the coalescing manager (``*_single_coalesced``), DeepSpeed's cached function references, FSDP2's
``all_gather_single``) ends in a method of ``torch.distributed.ProcessGroup``. ``count_collectives()``
wraps those methods on the class for the duration of a ``with`` block and restores them afterwards.

Counted: an all-gather by the bytes of its gathered output, a reduce-scatter by the bytes of its full input
(what one rank contributes). Not counted: collectives issued from C++ without going through Python (functional
collectives inside compiled graphs, a native op); for DeepCompile the engine's own report is used instead.
"""
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List

import torch
import torch.distributed as dist

_GATHER_METHODS = ("all_gather_single", "_allgather_base", "allgather", "allgather_into_tensor_coalesced",
                   "all_gather_single_coalesced")
_SCATTER_METHODS = ("reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter",
                    "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced")


@dataclass
class CommCounts:
    allgather_bytes: int = 0
    allgather_calls: int = 0
    reduce_scatter_bytes: int = 0
    reduce_scatter_calls: int = 0


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _wrap(name: str, original: Callable, counts: CommCounts, gather: bool) -> Callable:
    def counted(self, *args: Any, **kwargs: Any) -> Any:
        # Signatures: (output, input, opts) for every method here; list forms nest the tensors in lists.
        if gather:
            counts.allgather_bytes += _nbytes(args[0] if args else kwargs.get("output_tensors"))
            counts.allgather_calls += 1
        else:
            counts.reduce_scatter_bytes += _nbytes(args[1] if len(args) > 1 else kwargs.get("input_tensors"))
            counts.reduce_scatter_calls += 1
        return original(self, *args, **kwargs)

    counted.__name__ = name
    return counted


@contextlib.contextmanager
def count_collectives() -> Iterator[CommCounts]:
    """Count all-gather / reduce-scatter bytes of this process inside the block."""
    counts = CommCounts()
    cls = dist.ProcessGroup
    saved: List = []
    try:
        for names, gather in ((_GATHER_METHODS, True), (_SCATTER_METHODS, False)):
            for name in names:
                original = cls.__dict__.get(name)
                if original is None:
                    continue
                saved.append((name, original))
                setattr(cls, name, _wrap(name, original, counts, gather))
        yield counts
    finally:
        for name, original in saved:
            setattr(cls, name, original)

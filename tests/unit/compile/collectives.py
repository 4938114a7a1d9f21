# SPDX-License-Identifier: Apache-2.0
"""Count the reduction bytes a rank issues through ``torch.distributed`` (eager ZeRO-3 has no report of its own
to compare the compiled engine's with).

Every Python-level reduce-scatter and all-reduce of torch 2.13 that DeepSpeed issues (``reduce_scatter_tensor``, the
coalescing manager, its cached function references, ``all_reduce``) ends in a method of
``torch.distributed.ProcessGroup``; ``count_reductions()`` wraps those methods on the class for the duration of a
``with`` block and restores them afterwards. A reduce-scatter counts the bytes of its full input, an all-reduce those
of its tensor, separately: on gloo DeepCompile's ZeRO-3 reduces a gradient bucket as one all-reduce of it (what gloo's
reduce-scatter runs inside, ``runtime/z3_reduce.py``). (The benchmark has its own, wider counter.)
"""
import contextlib
from typing import Any, Iterator, List

import torch
import torch.distributed as dist

_METHODS = ("reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced",
            "reduce_scatter_single_coalesced")
_ALL_REDUCE_METHODS = ("allreduce",)


class Count:
    reduce_scatter_bytes = 0
    all_reduce_bytes = 0


def _nbytes(obj: Any) -> int:
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return obj.numel() * obj.element_size() if isinstance(obj, torch.Tensor) else 0


@contextlib.contextmanager
def count_reductions() -> Iterator[Count]:
    count = Count()
    cls = dist.ProcessGroup
    saved: List = [(name, cls.__dict__[name]) for name in _METHODS + _ALL_REDUCE_METHODS if name in cls.__dict__]

    def wrap(name, original):
        def counted(self, *args: Any, **kwargs: Any) -> Any:
            if name in _ALL_REDUCE_METHODS:  # (tensors, opts)
                count.all_reduce_bytes += _nbytes(args[0] if args else kwargs.get("tensors"))
            else:  # (output, input, opts); the list forms nest the tensors in lists
                count.reduce_scatter_bytes += _nbytes(args[1] if len(args) > 1 else kwargs.get("input_tensors"))
            return original(self, *args, **kwargs)
        return counted

    try:
        for name, original in saved:
            setattr(cls, name, wrap(name, original))
        yield count
    finally:
        for name, original in saved:
            setattr(cls, name, original)

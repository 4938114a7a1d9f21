"""Count the reduce-scatter bytes a rank issues through ``torch.distributed`` (eager ZeRO-3 has no report of its own
to compare the compiled engine's with).

Every Python-level reduce-scatter of torch 2.13 that DeepSpeed issues (``reduce_scatter_tensor``, the coalescing
manager, its cached function references) ends in a method of ``torch.distributed.ProcessGroup``;
``count_reduce_scatter()`` wraps those methods on the class for the duration of a ``with`` block and restores them
afterwards. A reduce-scatter counts the bytes of its full input. (The benchmark has its own, wider counter.)
"""
import contextlib
from typing import Any, Iterator, List

import torch
import torch.distributed as dist

_METHODS = ("reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced")


class Count:
    reduce_scatter_bytes = 0


def _nbytes(obj: Any) -> int:
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return obj.numel() * obj.element_size() if isinstance(obj, torch.Tensor) else 0


@contextlib.contextmanager
def count_reduce_scatter() -> Iterator[Count]:
    count = Count()
    cls = dist.ProcessGroup
    saved: List = [(name, cls.__dict__[name]) for name in _METHODS if name in cls.__dict__]

    def wrap(original):
        def counted(self, *args: Any, **kwargs: Any) -> Any:
            # (output, input, opts); the list forms nest the tensors in lists
            count.reduce_scatter_bytes += _nbytes(args[1] if len(args) > 1 else kwargs.get("input_tensors"))
            return original(self, *args, **kwargs)
        return counted

    try:
        for name, original in saved:
            setattr(cls, name, wrap(original))
        yield count
    finally:
        for name, original in saved:
            setattr(cls, name, original)

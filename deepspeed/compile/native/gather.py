# SPDX-License-Identifier: Apache-2.0
"""The fused cast + all-gather, native (``torch.ops.dsc_native.cast_all_gather``) and pure Python.

Both implement one contract: ``f(shard, dtype, group, world_size, timeout=None) -> flat``, where ``flat`` is a
new 1-D buffer of ``world_size * shard.numel()`` elements in ``dtype`` (the shard's dtype when None), rank r's
shard at ``[r * numel, (r + 1) * numel)``. The shard is cast *before* it is sent (a bf16 gather of fp32
shards moves half the bytes), and the gather is complete on return. The caller trims the padding
(``flat.narrow(0, 0, ds_numel).view(ds_shape)``).

``load_native(mode)`` chooses: "python" -> None; "native" -> the native function or an error naming the
option; "auto" -> the native function, or None after one warning that says why it is unavailable.
"""
import datetime
import functools
import logging
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import effects

logger = logging.getLogger(__name__)

NATIVE_MODES = ("auto", "native", "python")
OPTION = "compile.native_op"
OP_NAME = "dsc_native::cast_all_gather"
START_OP_NAME = "dsc_native::cast_all_gather_start"

CastAllGather = Callable[..., Tensor]


def _fake_cast_all_gather(shard: Tensor, dtype: Optional[torch.dtype], group_name: str, world_size: int,
                          timeout_ms: int = 0) -> Tensor:
    """Fake (meta) implementation: shape, dtype and device of the gathered buffer, no communication."""
    return shard.new_empty((world_size * shard.numel(), ), dtype=dtype or shard.dtype)


@functools.cache
def _load_library() -> Tuple[bool, str]:
    """Build/load the library once per process: (loaded, why not). The ops it registers are process-wide."""
    from .builder import NativeOpBuilder
    try:
        missing = effects.load_native_ops(lambda: NativeOpBuilder().load(),
                                          {OP_NAME: _fake_cast_all_gather, START_OP_NAME: _fake_cast_all_gather})
    except Exception as err:  # a failed build is reported to the user, never fatal by itself
        return False, f"{type(err).__name__}: {err}"
    return (False, missing) if missing else (True, "")


def native_op_error() -> Optional[str]:
    """Why the native op is unavailable in this process (building it if needed), or None when it loads."""
    loaded, reason = _load_library()
    return None if loaded else reason


@functools.cache
def _warn_unavailable(reason: str) -> None:
    logger.warning("deepspeed-compile: native op unavailable, using the Python cast + all-gather "
                   "(%s='auto'): %s", OPTION, reason)


def load_native(mode: str = "auto") -> Optional[CastAllGather]:
    """The native fused cast + all-gather (``cast_all_gather``) per ``compile.native_op``, or None.

    None means: use ``cast_all_gather_python``. "native" raises ``RuntimeError`` if the op cannot be built
    or loaded; "auto" logs one warning per process (per reason) and returns None.
    """
    if mode not in NATIVE_MODES:
        raise ValueError(f"{OPTION} must be one of {NATIVE_MODES}, got {mode!r}")
    if mode == "python":
        return None
    reason = native_op_error()
    if reason is None:
        return cast_all_gather
    if mode == "native":
        raise RuntimeError(f"{OPTION}='native' but the native op could not be built or loaded: {reason}. "
                           f"Set {OPTION} to 'auto' (fall back with a warning) or 'python'.")
    _warn_unavailable(reason)
    return None


def _group_name(group: Optional[dist.ProcessGroup]) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def _timeout_ms(timeout: Optional[datetime.timedelta]) -> int:
    if timeout is None:
        return 0
    return max(1, int(timeout.total_seconds() * 1000))


def cast_all_gather(shard: Tensor, dtype: Optional[torch.dtype], group: Optional[dist.ProcessGroup],
                    world_size: int, timeout: Optional[datetime.timedelta] = None) -> Tensor:
    """Native path: ``torch.ops.dsc_native.cast_all_gather`` on ``group`` (None: the default group)."""
    reason = native_op_error()
    if reason is not None:
        raise RuntimeError(f"native {OP_NAME} is unavailable: {reason}")
    # detach: the op has no autograd formula, and the shard of a ZeRO-3 parameter is data, not a graph input
    return torch.ops.dsc_native.cast_all_gather(shard.detach(), dtype, _group_name(group), world_size,
                                                _timeout_ms(timeout))


class InFlight:
    """A native all-gather started by ``cast_all_gather_start``: ``wait()`` completes it (torch's ``wait_tensor``,
    which finds the work c10d registered under the buffer) and ``flat`` is then the gathered buffer. The
    collective's own timeout (``timeout_ms``) bounds the wait."""

    def __init__(self, flat: Tensor):
        self.flat = flat
        self._done = False

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if not self._done:
            torch.ops._c10d_functional.wait_tensor(self.flat)
            self._done = True
        return True


def cast_all_gather_start(shard: Tensor, dtype: Optional[torch.dtype], group: Optional[dist.ProcessGroup],
                          world_size: int, timeout: Optional[datetime.timedelta] = None) -> InFlight:
    """Native start form of :func:`cast_all_gather`: the cast and the collective are issued, not waited for."""
    reason = native_op_error()
    if reason is not None:
        raise RuntimeError(f"native {START_OP_NAME} is unavailable: {reason}")
    return InFlight(torch.ops.dsc_native.cast_all_gather_start(shard.detach(), dtype, _group_name(group), world_size,
                                                               _timeout_ms(timeout)))


def cast_all_gather_python(shard: Tensor, dtype: Optional[torch.dtype], group: Optional[dist.ProcessGroup],
                           world_size: int, timeout: Optional[datetime.timedelta] = None) -> Tensor:
    """Pure-Python path of the same contract, through ``torch.distributed.all_gather_single``."""
    send = shard.detach().reshape(-1)
    if dtype is not None and dtype != send.dtype:
        send = send.to(dtype)  # cast the shard, then gather: less traffic
    flat = torch.empty(send.numel() * world_size, dtype=send.dtype, device=send.device)
    wait_for(dist.all_gather_single(flat, send, group=group, async_op=True), timeout)
    return flat


def wait_for(work, timeout: Optional[datetime.timedelta] = None) -> None:
    """Wait for a started collective; past ``timeout`` (None: forever) raise ``TimeoutError``."""
    if timeout is None:
        work.wait()
    elif not work.wait(timeout):
        raise TimeoutError(f"the collective did not complete within {timeout}")

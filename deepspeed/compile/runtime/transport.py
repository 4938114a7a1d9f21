# SPDX-License-Identifier: Apache-2.0
"""Where a runtime's collectives go: one :class:`Transport` per runtime, every stage.

It owns the data-parallel process group the runtime talks on, the shared-memory slots used in its place where every
rank is on this host (``compile.host_comm``, ``host_comm.py``), and, for ZeRO-3's gathers, which cast + all-gather
``compile.native_op`` loaded. The parts that issue collectives (``z3.py``'s single gathers, ``z3_runs.py``'s runs,
``z3_reduce.py``'s reduce-scatters, ``z12_reduce.py``'s bucket all-reduces) take the form to use from here.
"""
from typing import Optional

import torch
import torch.distributed as dist

from ..native.gather import CastAllGather, cast_all_gather_python
from .host_comm import DEFAULT_DIR, HostComm, open_host_comm


class Transport:

    def __init__(self, group, device: torch.device, host: Optional[HostComm], reason: Optional[str],
                 native: Optional[CastAllGather] = None):
        self.group = group
        self.world_size = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.device = device  # the device the graphs compute on and gather to
        self.host = host  # shared-memory slots, None where the collectives go through the process group
        self.reason = reason  # why not shared memory (None where it is)
        # the single gathers' cast + all-gather: the native op where it loaded, else torch.distributed from Python
        self.gather_op = "native" if native is not None else "python"
        self.cast_all_gather = native or cast_all_gather_python
        # coalesced gathers start through the native op's start form on CUDA, where it casts on the communication
        # stream; on CPU the shards are concatenated and cast in one copy (the op takes one shard, so it would copy
        # the run twice)
        self.native_start = native is not None and device.type == "cuda"
        # gloo's reduce-scatter is an all-reduce of which each rank keeps its row (z3_reduce.py)
        self.reduce_scatter_by_all_reduce = dist.get_backend(group) == "gloo"

    @classmethod
    def open(cls, mode: str, group, device: torch.device, *, gather_slot_bytes: int, reduce_slot_bytes: int,
             directory: str = DEFAULT_DIR, native: Optional[CastAllGather] = None) -> "Transport":
        """``compile.host_comm`` ``mode`` on ``group``: shared memory where it applies (slots of these sizes, 0: no
        such channel), else the process group."""
        host, reason = open_host_comm(mode, group, device, gather_slot_bytes=gather_slot_bytes,
                                      reduce_slot_bytes=reduce_slot_bytes, directory=directory)
        return cls(group, device, host, reason, native)

    @property
    def kind(self) -> str:
        """``"shm"`` (shared memory) or ``"gloo"`` (the process group): ``compile.host_comm`` as it applied."""
        return "gloo" if self.host is None else "shm"

    def close(self) -> None:
        """Release what the runtime holds of the OS, its shared-memory segments (the engine's deactivation and
        destroy; process exit does it too)."""
        if self.host is not None:
            self.host.close()

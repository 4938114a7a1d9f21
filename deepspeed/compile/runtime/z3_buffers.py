# SPDX-License-Identifier: Apache-2.0
"""The ZeRO-3 runtime's gathered buffers: each gathered copy of a parameter, its reference count and its lifetime.

A copy is keyed by its parameter and dtype: a parameter gathered by two graphs (or twice in one) is gathered once and
shared, each ``gather_param`` taking a reference and each ``release_param`` dropping one; the last release frees it.
A copy a coalesced run gathered ahead waits, unclaimed (no reference), for its own op.

[Note: forgotten copies] At the end of a backward and at an optimizer step the runtime lets go of every copy (its
weights are stale, or its backward never ran). One still referenced is then held only by an autograd graph that
saved it (an evaluation that forgot ``no_grad``): it is *forgotten*, not freed. Its storage goes with that graph, and
the graph's own release of it, if its backward runs after all, finds it forgotten and does nothing. The release op is
handed the tensor, so a copy is found from its address: the one index here keyed by address.
"""
import enum
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn import Parameter

from .comm import CommLog

Key = Tuple[int, torch.dtype]  # (ds_id, the dtype it was gathered in)


class Lifetime(enum.Enum):
    UNCLAIMED = "unclaimed"  # gathered ahead by a run; no op has taken it yet
    IN_USE = "in use"  # referenced by the ops that took it and have not released it
    FORGOTTEN = "forgotten"  # let go while still referenced (see the note): its releases are no-ops


@dataclass
class Buffer:
    key: Key
    tensor: Optional[Tensor]  # None once forgotten: the runtime holds no reference to a forgotten copy
    refs: int
    nbytes: int
    shard: Tuple[int, int]  # the parameter's shard_state it was gathered from

    @property
    def lifetime(self) -> Lifetime:
        if self.tensor is None:
            return Lifetime.FORGOTTEN
        return Lifetime.IN_USE if self.refs else Lifetime.UNCLAIMED


class GatheredBuffers:
    """Owns every gathered copy (``live``, by parameter and dtype) and the address index the release op needs
    (``_at``, forgotten copies included until their address is reused)."""

    def __init__(self, comm: CommLog, free_on_release: bool, step: int):
        self.comm = comm
        self.step = step  # the optimizer step the copies hold the weights of
        # Eager backend: nothing reuses a freed buffer, so a release frees the storage at once, whoever still holds
        # a Python reference. Inductor frees a buffer right after its last use and may hand its memory to a later
        # buffer ("reuse"): there the release only drops the runtime's reference, never the storage.
        self.free_on_release = free_on_release
        self.live: Dict[Key, Buffer] = {}
        self._at: Dict[int, Buffer] = {}  # a copy's data_ptr -> its buffer

    def __contains__(self, key: Key) -> bool:
        return key in self.live

    def take(self, key: Key) -> Optional[Tensor]:
        """A reference to the gathered copy of ``key``, if there is one."""
        buffer = self.live.get(key)
        if buffer is None:
            return None
        buffer.refs += 1
        return buffer.tensor

    def add(self, param: Parameter, dtype: torch.dtype, flat: Tensor, refs: int, shard: Tuple[int, int],
            collective: bool = True) -> Tensor:
        """A new copy of ``param`` in ``dtype`` (``flat``: its gathered elements, padding included), with ``refs``
        references; ``collective``: gathered by a collective (counted as the graphs' gather), not copied."""
        full = flat.narrow(0, 0, param.ds_numel).view(param.ds_shape)
        nbytes = flat.numel() * flat.element_size()
        buffer = Buffer((param.ds_id, dtype), full, refs, nbytes, shard)
        self.live[buffer.key] = buffer
        self._at[full.data_ptr()] = buffer  # replaces a forgotten copy whose storage was freed and reused
        if collective:
            c = self.comm.counters.gather
            c.gathers += 1
            c.allgather_bytes += nbytes
            c.allgather_bytes_by_dtype[str(dtype)] = c.allgather_bytes_by_dtype.get(str(dtype), 0) + nbytes
        self.comm.add_live_bytes(nbytes, eager=False)
        return full

    def release(self, tensor: Tensor) -> None:
        """One reference to the gathered copy ``tensor`` dropped; the last frees it (see ``free_on_release``)."""
        buffer = self._at.get(tensor.data_ptr())
        if buffer is not None and buffer.lifetime is Lifetime.FORGOTTEN:
            return
        if buffer is None or buffer.key[1] != tensor.dtype or self.live.get(buffer.key) is not buffer:
            raise AssertionError(f"release of a tensor ({tensor.dtype}, shape {tuple(tensor.shape)}) that is not a "
                                 "gathered parameter")
        buffer.refs -= 1
        if buffer.refs == 0:
            self._drop(buffer)

    def _drop(self, buffer: Buffer) -> None:
        del self.live[buffer.key]
        del self._at[buffer.tensor.data_ptr()]
        if self.free_on_release:
            buffer.tensor.untyped_storage().resize_(0)
        self.comm.add_live_bytes(-buffer.nbytes, eager=False)

    def forget(self, key: Key) -> int:
        """The runtime lets go of a copy and returns its bytes: an unclaimed one is freed, one still referenced is
        forgotten (the module's note)."""
        buffer = self.live[key]
        if buffer.refs == 0:
            self.comm.counters.gather.unclaimed_gathers += 1
            self._drop(buffer)
            return buffer.nbytes
        del self.live[key]
        buffer.tensor = None
        self.comm.add_live_bytes(-buffer.nbytes, eager=False)
        return buffer.nbytes

    def forget_unclaimed(self) -> None:
        for key in [k for k, b in self.live.items() if b.refs == 0]:
            self.forget(key)

    def forget_changed(self, shard_of) -> None:
        """Forget the copies whose parameter's shard changed since they were gathered (``shard_of(ds_id)``: its
        ``shard_state`` now)."""
        for key in [k for k, b in self.live.items() if b.shard != shard_of(k[0])]:
            self.forget(key)

    def forget_referenced(self) -> int:
        """Forget every copy still referenced (the note). Returns the bytes of those that stay allocated once the
        runtime lets go: held by an autograd graph still alive (its output kept) whose backward has not run. A graph
        whose output was dropped (``.item()`` of an evaluation's loss, a result used detached, as peft's DoRA uses
        its weight norm) is gone already, and so are its copies once forgotten."""
        keys = [key for key, buffer in self.live.items() if buffer.refs > 0]
        storages: Dict[int, Tuple[StorageWeakRef, int]] = {}  # a run's members share one flat storage
        for key in keys:
            storage = self.live[key].tensor.untyped_storage()
            storages.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
            del storage  # no reference of ours may outlive the forgetting below
        for key in keys:
            self.forget(key)
        return sum(nbytes for ref, nbytes in storages.values() if not ref.expired())

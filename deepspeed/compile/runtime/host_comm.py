# SPDX-License-Identifier: Apache-2.0
"""Collectives between the ranks of one host through shared memory (``compile.host_comm``).

gloo moves a collective's bytes through loopback sockets, copied by the kernel on the same cores the ranks compute on
(``benchmarks/gloo_collectives.py`` times both). When every rank of the group is on this host, the ZeRO-3 runtime's
all-gathers and gradient reductions, and ZeRO-2's bucket all-reduces, go through shared memory instead: each rank
copies what it sends into a slot of its own segment, and every rank reads every rank's slot straight into where the
result goes. ``docs/design.md`` ("Collectives through shared memory") states what the transport guarantees and costs.

**Set-up** is one step the ranks agree on (``shm_segments.py``): one segment a rank, its space reserved, every peer's
verified, released on every path out. Any failure on any rank: ``"auto"`` goes on with the process group (one warning
naming the option and the reason) and ``"shm"`` raises ``ValueError`` (:func:`open_host_comm`).
:meth:`HostComm.close` (the engine's destroy) and process exit release the segments.

**The protocol.** A :class:`Channel` has ``slots`` slots per rank; its collective number ``n`` uses slot
``n % slots``. Each rank's header holds, per slot, ``published`` (the collective whose data the slot holds), what that
collective is (bytes, kind, dtype, an identifier), and ``consumed`` (the last collective this rank has read out of
every rank's slot), both as ``n + 1`` (a new segment is zeros: nothing published or read). A rank writes its slot
for ``n`` once every other rank has consumed ``n - slots`` there, and reads ``n`` once every rank has published it; a rank whose collective ``n`` differs from a peer's raises an error naming
both. Every rank starts the same collectives in the same order (the runtime's contract for any transport), and a rank
that needs a slot first reads the collectives before it that it has not read yet, so the oldest collective of a channel
can always complete. A wait on one channel also moves every other channel of the runtime as far as it can without
waiting, so ranks that wait on the channels in different orders complete too.

**Waits are bounded.** A wait spins briefly, then yields its core, then sleeps in growing steps, and every tenth of a
second checks its peers: a peer whose process is gone (its segment lock released by the kernel), that closed its
segments, or that posted a failure (:meth:`HostComm.post_failure`) ends the wait with a :class:`HostCommError` naming
the rank. Past the timeout (``compile.collective_timeout_s``, else the process group's own) a wait gives up.

The flags are 8-byte aligned words written and read by single loads and stores with the data copies finished before
(a copy's worker threads are joined first); x86-64's store order makes a peer that sees a flag see the data written
before it. Other architectures need fences this module does not have, so ``"auto"`` uses it on x86-64 only.
"""
import datetime
import logging
import mmap
import os
import time
import weakref
from collections import deque
from typing import Callable, Deque, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from .shm_segments import (CLOSED, DEFAULT_DIR, FAILED, PAGE, Segments, SetUpError, group_timeout,
                           host_comm_unavailable)

log = logging.getLogger(__name__)

HOST_COMM_MODES = ("auto", "shm", "gloo")
# the largest chunk of a gradient bucket reduced at once; smaller where the model's gradients are
REDUCE_SLOT_BYTES = 4 << 20
GATHER_SLOTS, REDUCE_SLOTS = 8, 4
_ALIGN = 64
# a wait: this many polls on the core, then yielding it for this long, then sleeps from the first to the last length
_SPINS, _YIELD_S, _SLEEP_S = 100, 0.002, (50e-6, 1e-3)
_CHECK_PEERS_S = 0.1  # how often a wait past its spins looks at its peers' liveness and state
# what a slot's collective is: its kind, and the dtype it carries (an index of _DTYPES)
KIND_RAW, KIND_GATHER, KIND_REDUCE_SCATTER, KIND_ALL_REDUCE = range(4)
_KIND_NAMES = ("collective", "all-gather", "reduce-scatter", "all-reduce")
_DTYPES = (torch.uint8, torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64)
# per slot, in a channel's header: published, consumed, bytes, kind, dtype, identifier
_FIELDS = 6


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class HostCommError(RuntimeError):
    """A collective through shared memory cannot complete: a peer is gone, closed its segments or failed, or the ranks
    started different collectives."""


def _describe(nbytes: int, kind: int, dtype: int, ident: int) -> str:
    kind_name = _KIND_NAMES[kind] if 0 <= kind < len(_KIND_NAMES) else f"kind {kind}"
    dtype_name = str(_DTYPES[dtype]).replace("torch.", "") if 0 <= dtype < len(_DTYPES) else f"dtype {dtype}"
    what = f" (id {ident})" if ident >= 0 else ""
    return f"{kind_name} of {nbytes} bytes of {dtype_name}{what}"


class Work:
    """A collective of a :class:`Channel`, started; ``wait(timeout)`` returns False past ``timeout`` (a
    ``datetime.timedelta``; None: the default), else True with ``result`` set."""
    __slots__ = ("channel", "seq", "nbytes", "what", "fill", "take", "published", "done", "result")

    def __init__(self, channel: "Channel", seq: int, nbytes: int, what: Tuple[int, int, int],
                 fill: Callable[[Tensor], None], take: Callable[[List[Tensor]], object]):
        self.channel, self.seq, self.nbytes, self.what, self.fill, self.take = channel, seq, nbytes, what, fill, take
        self.published = self.done = False
        self.result = None

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if timeout is not None:
            return self.channel._wait(self, timeout)
        timeout = self.channel.host.timeout
        if not self.channel._wait(self, timeout):  # as torch.distributed's own wait, a clear error
            raise TimeoutError(f"{self.channel.name(self)} did not complete within {timeout} (the process group's "
                               "timeout): a rank did not join it")
        return True


class Channel:
    """One kind of collective between the ranks of a host, in ``slots`` slots of ``slot_bytes`` per rank:
    ``start(nbytes, fill, take)`` has ``fill`` write this rank's ``nbytes`` into its slot (a uint8 tensor), and when
    every rank has, ``take`` read all ranks' slots (one uint8 tensor of ``nbytes`` per rank, in rank order) into the
    work's result. A slot is only valid inside ``take``. Made by :class:`HostComm`, in each rank's segment at
    ``offset``."""

    def __init__(self, host: "HostComm", label: str, maps: List[mmap.mmap], offset: int, slot_bytes: int, slots: int):
        self.host, self.label, self.slots, self.slot_bytes = host, label, slots, slot_bytes
        self.rank, self.world_size = host.rank, host.world_size
        header = channel_header_bytes(slots)
        self._meta = [np.frombuffer(m, dtype=np.int64, count=_FIELDS * slots, offset=offset).reshape(_FIELDS, slots)
                      for m in maps]
        self._published = [meta[0] for meta in self._meta]
        self._consumed = [meta[1] for meta in self._meta]
        self._data = [torch.frombuffer(m, dtype=torch.uint8, offset=offset + header,
                                       count=slots * slot_bytes).view(slots, slot_bytes) for m in maps]
        self._others = [r for r in range(self.world_size) if r != self.rank]
        self._next = 0
        self._open: Deque[Work] = deque()  # started and not yet read, oldest first

    def start(self, nbytes: int, fill: Callable[[Tensor], None], take: Callable[[List[Tensor]], object],
              kind: int = KIND_RAW, dtype: torch.dtype = torch.uint8, ident: int = -1) -> Work:
        """``kind``, ``dtype`` and ``ident`` say what the collective is: a peer that starts another one in its place
        is an error naming both."""
        assert nbytes <= self.slot_bytes, f"a collective of {nbytes} bytes for a slot of {self.slot_bytes}"
        work = Work(self, self._next, nbytes, (kind, _DTYPES.index(dtype) if dtype in _DTYPES else -1, ident),
                    fill, take)
        self._next += 1
        self._open.append(work)
        self.progress()  # published now where the protocol allows it without waiting, else by a later wait
        return work

    @property
    def started(self) -> int:
        """Collectives started on this channel so far."""
        return self._next

    def name(self, work: Work) -> str:
        return f"the {_describe(work.nbytes, *work.what)} (collective #{work.seq} of the shared-memory " \
               f"{self.label} channel, compile.host_comm)"

    # ----- the protocol ------------------------------------------------------------------------------------
    def _can_publish(self, work: Work) -> bool:
        """In order, nothing older than the slot's last collective left to read here, and the slot free."""
        s, old = work.seq % self.slots, work.seq - self.slots
        return self._open[0].seq > old and (old < 0 or all(self._consumed[r][s] > old for r in self._others))

    def _publish(self, work: Work) -> None:
        s = work.seq % self.slots
        work.fill(self._data[self.rank][s, :work.nbytes])
        work.fill = None
        meta = self._meta[self.rank]
        meta[2, s], (meta[3, s], meta[4, s], meta[5, s]) = work.nbytes, work.what
        self._published[self.rank][s] = work.seq + 1  # last: a peer that sees it sees the data and what it is
        work.published = True

    def _all_published(self, work: Work) -> bool:
        s = work.seq % self.slots
        return all(self._published[r][s] == work.seq + 1 for r in self._others)

    def _read(self, work: Work) -> None:
        s = work.seq % self.slots
        mine = (work.nbytes, *work.what)
        for r in self._others:
            theirs = tuple(int(v) for v in self._meta[r][2:, s])
            if theirs != mine:
                err = self.host.fail(HostCommError(
                    f"deepspeed-compile: the ranks started different collectives through shared memory "
                    f"(compile.host_comm): as collective #{work.seq} of the {self.label} channel, rank {self.rank} "
                    f"started the {_describe(*mine)} and rank {r} the {_describe(*theirs)}. Every rank must issue the "
                    "same collectives in the same order: the ranks went down different paths"))
                self.host.diverged(f"rank {r} started another collective")
                raise err
        work.result = work.take([self._data[r][s, :work.nbytes] for r in range(self.world_size)])
        work.take = None
        self._consumed[self.rank][s] = work.seq + 1
        work.done = True

    def progress(self) -> None:
        """Publish and read what can be without waiting, in order."""
        while self._open:
            unpublished = next((w for w in self._open if not w.published), None)
            if unpublished is not None and self._can_publish(unpublished):
                self._publish(unpublished)
                continue
            oldest = self._open[0]
            if not (oldest.published and self._all_published(oldest)):
                return
            self._read(oldest)
            self._open.popleft()

    def _wait(self, work: Work, timeout: datetime.timedelta) -> bool:
        """Publishes and reads in order of collective up to ``work``: this rank's own data first, and a slot's
        older collective read here before the slot is written again. Every rank doing so, the oldest collective
        not read everywhere can always complete (its data is published; its slot is free)."""
        deadline = time.monotonic() + timeout.total_seconds()
        while not work.done:
            oldest = self._open[0]
            target = next((w for w in self._open if not w.published), None)
            if target is not None and target.seq <= work.seq and oldest.seq > target.seq - self.slots:
                if not self.host.poll_until(lambda: self._can_publish(target), deadline, self, work):
                    return False
                self._publish(target)
                continue
            if not self.host.poll_until(lambda: self._all_published(oldest), deadline, self, work):
                return False
            self._read(oldest)
            self._open.popleft()
        return True


def channel_header_bytes(slots: int) -> int:
    return _round_up(_FIELDS * slots * 8, _ALIGN)


def channel_bytes(slot_bytes: int, slots: int) -> int:
    return channel_header_bytes(slots) + slots * slot_bytes


def start_gather(channel: Channel, shards: List[Tensor], dtype: torch.dtype,
                 ident: int = -1) -> Tuple[List[Tensor], Work]:
    """Every rank's ``shards`` (1-D, the same widths on every rank) gathered through ``channel``, cast to ``dtype``:
    a buffer per shard (world size x its width, rank-major, as an all-gather lays it out) and the last of the
    collectives filling them, a slot's worth of the shards back to back each (a shard wider than a slot spans
    several); a channel reads in order, so waiting for the last waits for them all. Each is copied into this rank's
    slot when started (the cast in the same copy) and out of every rank's slot when read. ``ident`` names the
    collectives for the ranks' check that they agree (a parameter's ``ds_id``)."""
    world, widths = channel.world_size, [shard.numel() for shard in shards]
    outs = [torch.empty(world * width, dtype=dtype, device=shard.device) for shard, width in zip(shards, widths)]
    starts = [0]
    for width in widths:
        starts.append(starts[-1] + width)
    step = channel.slot_bytes // dtype.itemsize
    works = []
    for a in range(0, max(starts[-1], 1), step):  # nothing to gather is one collective too
        b = min(a + step, starts[-1])
        # (shard, from, to) of the shards' elements a..b
        pieces = [(i, max(a, lo) - lo, min(b, hi) - lo) for i, (lo, hi) in enumerate(zip(starts, starts[1:]))
                  if lo < b and hi > a]
        works.append(channel.start((b - a) * dtype.itemsize,
                                   lambda slot, pieces=pieces: _fill_pieces(slot.view(dtype), shards, pieces),
                                   lambda rows, pieces=pieces: _take_pieces([row.view(dtype) for row in rows],
                                                                            outs, widths, pieces),
                                   kind=KIND_GATHER, dtype=dtype, ident=ident))
    return outs, works[-1]


def _fill_pieces(slot: Tensor, shards: List[Tensor], pieces) -> None:
    if pieces:
        torch.cat([shards[i][lo:hi] for i, lo, hi in pieces], out=slot)


def _take_pieces(rows: List[Tensor], outs: List[Tensor], widths: List[int], pieces) -> None:
    offset = 0
    for i, lo, hi in pieces:
        n = hi - lo
        if n == widths[i]:  # the whole shard: every rank's, side by side, in one copy
            torch.cat([row[offset:offset + n] for row in rows], out=outs[i])
        else:
            for r, row in enumerate(rows):
                outs[i][r * widths[i] + lo:r * widths[i] + hi].copy_(row[offset:offset + n])
        offset += n


def start_sum(channel: Channel, columns: Tensor, row: Optional[int], ident: int = -1, divisor: int = 1) -> Work:
    """Every rank's ``columns`` (2-D, any strides) summed through ``channel``, chunk by chunk of columns, into
    ``columns[row]`` (this rank's row of a ZeRO-3 bucket: a reduce-scatter) or, with ``row`` None, into all of
    ``columns`` (an all-reduce); returns the last chunk's collective, whose wait waits for them all (a channel reads in
    order). Each chunk is written to this rank's slot when started, divided by ``divisor`` on the way (the division
    a bucket is given before it is summed, without a pass of its own), and summed, in rank order, from every rank's
    slot when read; ``columns`` must not change in between."""
    height, width = columns.shape
    step = max(1, channel.slot_bytes // (height * columns.element_size()))
    kind = KIND_ALL_REDUCE if row is None else KIND_REDUCE_SCATTER
    works = []
    for start in range(0, max(width, 1), step):  # an empty bucket too is one collective, as gloo's would be
        chunk = columns[:, start:start + step]
        out = chunk if row is None else chunk[row]
        works.append(channel.start(chunk.numel() * chunk.element_size(),
                                   lambda slot, chunk=chunk: _write(slot.view(chunk.dtype).view(chunk.shape), chunk,
                                                                    divisor),
                                   lambda slots, chunk=chunk, out=out: _sum(slots, chunk, out, row),
                                   kind=kind, dtype=columns.dtype, ident=ident))
    return works[-1]


def _write(slot: Tensor, chunk: Tensor, divisor: int) -> None:
    if divisor == 1:
        slot.copy_(chunk)
    else:
        torch.div(chunk, divisor, out=slot)


def _sum(slots: List[Tensor], chunk: Tensor, out: Tensor, row: Optional[int]) -> None:
    parts = [slot.view(chunk.dtype).view(chunk.shape) for slot in slots]
    if row is not None:
        parts = [part[row] for part in parts]
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)


class HostComm:
    """A runtime's shared-memory transport: channel ``gather`` (slots of a gathered chunk's shard; None without one)
    and ``reduce`` (slots of a chunk of a gradient bucket), in one segment a rank. Made by :func:`open_host_comm`."""

    def __init__(self, group, gather_slot_bytes: int, reduce_slot_bytes: int, directory: str = DEFAULT_DIR,
                 gather_slots: int = GATHER_SLOTS, reduce_slots: int = REDUCE_SLOTS):
        """Sets up the segments as one step the ranks agree on; raises :class:`HostCommError` saying why when any
        rank cannot, after every rank has released what it made."""
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.timeout = group_timeout(group)
        gather_slot_bytes = _round_up(gather_slot_bytes, _ALIGN) if gather_slot_bytes else 0
        reduce_slot_bytes = _round_up(max(reduce_slot_bytes, _ALIGN), _ALIGN)
        gather_at = PAGE
        reduce_at = gather_at + (channel_bytes(gather_slot_bytes, gather_slots) if gather_slot_bytes else 0)
        self.bytes = _round_up(reduce_at + channel_bytes(reduce_slot_bytes, reduce_slots), PAGE)  # this rank's
        try:
            self._segments = Segments.set_up(group, directory, self.bytes)
        except SetUpError as err:
            raise HostCommError(str(err)) from None
        # process exit releases the segments of a runtime never closed
        self._finalizer = weakref.finalize(self, Segments.close, self._segments)
        maps = self._segments.maps
        self._others = [r for r in range(self.world_size) if r != self.rank]
        self.gather = Channel(self, "gather", maps, gather_at, gather_slot_bytes, gather_slots) \
            if gather_slot_bytes else None
        self.reduce = Channel(self, "reduce", maps, reduce_at, reduce_slot_bytes, reduce_slots)
        self.channels = [c for c in (self.gather, self.reduce) if c is not None]
        self.closed = False
        # called (with why) before a wait raises because the ranks cannot go on down one path: a peer posted a failure,
        # or started another collective; the runtime's owner falls back to eager ZeRO, as the peers do
        self.on_diverged: Optional[Callable[[str], None]] = None

    # ----- waits -----------------------------------------------------------------------------------------------
    def poll_until(self, ready: Callable[[], bool], deadline: float, channel: Channel, work: Work) -> bool:
        """Wait until ``ready()`` (True) or ``deadline`` (False), moving the other channels meanwhile; a peer gone,
        closed or failed raises :class:`HostCommError`."""
        polls, pause = 0, _SLEEP_S[0]
        began = next_check = None
        while not ready():
            polls += 1
            if polls <= _SPINS:  # most waits end here: nothing else to do yet
                continue
            for other in self.channels:  # the other channels moved meanwhile (the module docstring)
                if other is not channel:
                    other.progress()
            now = time.monotonic()
            if began is None:
                began, next_check = now, now + _CHECK_PEERS_S
            if now - began < _YIELD_S:
                os.sched_yield()  # the other ranks may need this core to get here
            else:
                time.sleep(pause)
                pause = min(2 * pause, _SLEEP_S[1])
            if now >= next_check:
                self.check_peers(lambda: channel.name(work))
                if now > deadline:
                    return False
                next_check = now + _CHECK_PEERS_S
        return True

    def check_peers(self, waiting_for: Callable[[], str] = lambda: "a collective") -> None:
        """Raise :class:`HostCommError` naming the first peer whose process is gone, or that closed its segments or
        posted a failure."""
        for r in self._others:
            state = self._segments.state(r)
            if state == FAILED:
                why = f"failed: {self._segments.message(r)}"
            elif state == CLOSED:
                why = "closed its shared-memory segments (its engine was destroyed)"
            elif self._segments.gone(r):
                why = "exited: its process is gone"
            else:
                continue
            err = self.fail(HostCommError(f"deepspeed-compile: rank {r} {why}, while rank {self.rank} waits for "
                                          f"{waiting_for()}"), post=state != FAILED)
            if state == FAILED:
                self.diverged(why)
            raise err

    # ----- failures and the end -----------------------------------------------------------------------------------
    def post_failure(self, message: str) -> None:
        """Tell the peers this rank cannot go on (``message`` says why): a peer's next wait on shared memory raises
        naming this rank and ``message``, instead of waiting for collectives this rank will not start."""
        if not self.closed:
            self._segments.set_state(FAILED, message)

    def diverged(self, why: str) -> None:
        if self.on_diverged is not None:
            self.on_diverged(why)

    def fail(self, err: HostCommError, post: bool = True) -> HostCommError:
        """``err``, posted to the peers first (they stop too); for ``raise self.fail(...)``."""
        if post:
            self.post_failure(str(err))
        return err

    def close(self) -> None:
        """Release the segments (the engine's destroy; process exit does it too): the peers' waits that still need
        this rank raise, and the memory is returned once every rank has closed."""
        if self.closed:
            return
        self.closed = True
        for channel in self.channels:
            channel._meta = channel._published = channel._consumed = channel._data = None
        self._finalizer()


def open_host_comm(mode: str, group, device: torch.device, gather_slot_bytes: int, reduce_slot_bytes: int,
                   directory: str = DEFAULT_DIR) -> Tuple[Optional[HostComm], Optional[str]]:
    """``compile.host_comm``: the transport and, where it is not shared memory, why. ``"gloo"``: none. ``"shm"``:
    shared memory or a ``ValueError`` saying why not. ``"auto"``: shared memory where every rank is on this host (CPU,
    gloo, x86-64) and can set up its segments in ``directory``, else none, with one warning saying why when the
    segments could not be set up. ``gather_slot_bytes`` 0: no gather channel. Every rank gets the same answer."""
    if mode not in HOST_COMM_MODES:
        raise ValueError(f"compile.host_comm: {mode!r} is not one of {', '.join(HOST_COMM_MODES)}")
    if mode == "gloo":
        return None, "compile.host_comm is 'gloo'"
    reason = host_comm_unavailable(group, device, directory)
    if reason is None:
        try:
            return HostComm(group, gather_slot_bytes, reduce_slot_bytes, directory), None
        except HostCommError as err:
            reason = f"setting up its segments failed on {err}"
            if mode == "auto":
                log.warning(f"deepspeed-compile: compile.host_comm='auto': the runtime's collectives go through the "
                            f"process group, not shared memory: {reason}")
    if mode == "shm":
        raise ValueError(f"compile.host_comm='shm' cannot be used: {reason}")
    return None, reason

"""Collectives between the ranks of one host through shared memory (``compile.host_comm``).

gloo moves a collective's bytes through loopback sockets, copied by the kernel on the same cores the ranks compute on:
on 2 CPU ranks it takes about 9 ms to all-gather 16 MiB that one copy moves in 1.5 ms
(``benchmarks/gloo_collectives.py``). When every rank of the group is on this host, the ZeRO-3 runtime's
all-gathers and gradient reductions, and ZeRO-2's bucket all-reduces, go through shared memory instead: each rank
copies what it sends into a slot of its own segment, and every rank reads every rank's slot straight into where the
result goes.

A :class:`Channel` has ``slots`` slots per rank; its collective number ``n`` uses slot ``n % slots``. Each rank's
header holds, per slot, ``published`` (the collective whose data the slot holds) and ``consumed`` (the last collective
this rank has read out of every rank's slot). A rank writes its slot for ``n`` once every other rank has consumed
``n - slots`` there, and reads ``n`` once every rank has published it. Every rank starts the same collectives in the
same order (the runtime's contract for any transport), and a rank that needs a slot first reads the collectives before
it that it has not read yet, so the oldest collective can always complete: nothing waits on a later one, and a wait
past its timeout raises ``TimeoutError``.

The flags are 8-byte aligned words written and read by single loads and stores with the data copies finished before
(a copy's worker threads are joined first); x86-64's store order makes a peer that sees a flag see the data written
before it. Other architectures need fences this module does not have, so ``"auto"`` uses it on x86-64 only.
"""
import datetime
import mmap
import os
import platform
import secrets
import socket
import time
from collections import deque
from typing import Callable, Deque, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

HOST_COMM_MODES = ("auto", "shm", "gloo")
# a reduce slot: a chunk of a gradient bucket reduced at once (a gather slot holds a rank's share of a run's chunk,
# z3.py); 4 of them and 8 gather slots make this rank's segments 16 + 16 MiB at 2 ranks
REDUCE_SLOT_BYTES = 4 << 20
_ALIGN = 64
# every page mapped at set-up, not faulted in at a slot's first use
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_PAGE = 4096
# a wait with no timeout of its own (compile.collective_timeout_s 0) gives up after torch.distributed's default
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class Work:
    """A collective of a :class:`Channel`, started; ``wait(timeout)`` returns False past ``timeout`` (a
    ``datetime.timedelta``; None: the default), else True with ``result`` set."""
    __slots__ = ("channel", "seq", "nbytes", "fill", "take", "published", "done", "result")

    def __init__(self, channel: "Channel", seq: int, nbytes: int, fill: Callable[[Tensor], None],
                 take: Callable[[List[Tensor]], object]):
        self.channel, self.seq, self.nbytes, self.fill, self.take = channel, seq, nbytes, fill, take
        self.published = self.done = False
        self.result = None

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if timeout is not None:
            return self.channel._wait(self, timeout)
        if not self.channel._wait(self, _DEFAULT_TIMEOUT):  # as torch.distributed's own default, a clear error
            raise TimeoutError(f"a collective through shared memory (compile.host_comm) did not complete within "
                               f"{_DEFAULT_TIMEOUT}: a rank did not join it")
        return True


class Channel:
    """One kind of collective between the ranks of a host: ``start(nbytes, fill, take)`` has ``fill`` write this
    rank's ``nbytes`` into its slot (a uint8 tensor), and when every rank has, ``take`` read all ranks' slots (one
    uint8 tensor of ``nbytes`` per rank, in rank order) into the work's result. A slot is only valid inside ``take``."""

    def __init__(self, group, rank: int, world_size: int, slot_bytes: int, slots: int, token: str, name: str):
        self.rank, self.world_size, self.slots = rank, world_size, slots
        self.slot_bytes = _round_up(max(slot_bytes, _ALIGN), _ALIGN)
        header = _round_up(2 * slots * 8, _PAGE)
        size = header + slots * self.slot_bytes
        paths = [f"/dev/shm/dsc_{token}_{name}_{r}" for r in range(world_size)]
        fd = os.open(paths[rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mine = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        np.frombuffer(mine, dtype=np.int64, count=2 * slots)[:] = -1
        dist.barrier(group=group)  # every rank's segment exists, its flags cleared
        self._maps: List[mmap.mmap] = []
        for r, path in enumerate(paths):
            if r == rank:
                self._maps.append(mine)
                continue
            fd = os.open(path, os.O_RDWR)
            try:
                self._maps.append(mmap.mmap(fd, size, flags=_MAP_FLAGS))
            finally:
                os.close(fd)
        dist.barrier(group=group)  # every rank has mapped every segment: the names can go
        os.unlink(paths[rank])
        # per rank: published[slot], consumed[slot]; and the slots' bytes
        self._published = [np.frombuffer(m, dtype=np.int64, count=slots) for m in self._maps]
        self._consumed = [np.frombuffer(m, dtype=np.int64, count=slots, offset=slots * 8) for m in self._maps]
        self._data = [torch.frombuffer(m, dtype=torch.uint8, offset=header).view(slots, self.slot_bytes)
                      for m in self._maps]
        self._others = [r for r in range(world_size) if r != rank]
        self._next = 0
        self._open: Deque[Work] = deque()  # started and not yet read, oldest first
        self.bytes = size  # this rank's segment

    def start(self, nbytes: int, fill: Callable[[Tensor], None], take: Callable[[List[Tensor]], object]) -> Work:
        assert nbytes <= self.slot_bytes, f"a collective of {nbytes} bytes for a slot of {self.slot_bytes}"
        work = Work(self, self._next, nbytes, fill, take)
        self._next += 1
        self._open.append(work)
        # published now where the protocol allows it without waiting (in order, the slot free, nothing older than
        # the slot's last collective left to read here), else by the first wait that needs it
        if (len(self._open) == 1 or self._open[-2].published) and self._open[0].seq > work.seq - self.slots \
                and self._slot_free(work.seq):
            self._publish(work)
        return work

    # ----- the protocol ------------------------------------------------------------------------------------
    def _slot_free(self, seq: int) -> bool:
        s, old = seq % self.slots, seq - self.slots
        return old < 0 or all(self._consumed[r][s] >= old for r in self._others)

    def _publish(self, work: Work) -> None:
        s = work.seq % self.slots
        work.fill(self._data[self.rank][s, :work.nbytes])
        work.fill = None
        self._published[self.rank][s] = work.seq
        work.published = True

    def _read(self, work: Work) -> None:
        s = work.seq % self.slots
        work.result = work.take([self._data[r][s, :work.nbytes] for r in range(self.world_size)])
        work.take = None
        self._consumed[self.rank][s] = work.seq
        work.done = True

    def _spin(self, ready: Callable[[], bool], deadline: float) -> bool:
        tries = 0
        while not ready():
            tries += 1
            if tries > 100:
                os.sched_yield()  # the other ranks may need this core to get here
                if tries % 1000 == 0 and time.monotonic() > deadline:
                    return False
        return True

    def _wait(self, work: Work, timeout: datetime.timedelta) -> bool:
        """Publishes and reads in order of collective up to ``work``: this rank's own data first, and a slot's
        older collective read here before the slot is written again. Every rank doing so, the oldest collective
        not read everywhere can always complete (its data is published; its slot is free)."""
        deadline = time.monotonic() + timeout.total_seconds()
        while not work.done:
            oldest = self._open[0]
            target = next((w for w in self._open if not w.published), None)
            if target is not None and target.seq <= work.seq and oldest.seq > target.seq - self.slots:
                if not self._spin(lambda: self._slot_free(target.seq), deadline):
                    return False
                self._publish(target)
                continue
            s, seq = oldest.seq % self.slots, oldest.seq
            if not self._spin(lambda: all(self._published[r][s] == seq for r in self._others), deadline):
                return False
            self._read(oldest)
            self._open.popleft()
        return True


def start_gather(channel: Channel, shards: List[Tensor], dtype: torch.dtype) -> Tuple[List[Tensor], Work]:
    """Every rank's ``shards`` (1-D, the same widths on every rank) gathered through ``channel``, cast to ``dtype``:
    a buffer per shard (world size x its width, rank-major, as an all-gather lays it out) and the last of the
    collectives filling them, a slot's worth of the shards back to back each (a shard wider than a slot spans
    several); a channel reads in order, so waiting for the last waits for them all. Each is copied into this rank's
    slot when started (the cast in the same copy) and out of every rank's slot when read."""
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
                                                                            outs, widths, pieces)))
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


def start_sum(channel: Channel, columns: Tensor, row: Optional[int]) -> Work:
    """Every rank's ``columns`` (2-D) summed through ``channel``, chunk by chunk of columns, into ``columns[row]``
    (this rank's row of a ZeRO-3 bucket: a reduce-scatter) or, with ``row`` None, into all of ``columns`` (an
    all-reduce); returns the last chunk's collective, whose wait waits for them all (a channel reads in order). Each
    chunk is written to this rank's slot when started and summed, in rank order, from every rank's slot when read;
    ``columns`` must not change in between."""
    height, width = columns.shape
    step = max(1, channel.slot_bytes // (height * columns.element_size()))
    works = []
    for start in range(0, max(width, 1), step):  # an empty bucket too is one collective, as gloo's would be
        chunk = columns[:, start:start + step]
        out = chunk if row is None else chunk[row]
        works.append(channel.start(chunk.numel() * chunk.element_size(),
                                   lambda slot, chunk=chunk: slot.view(chunk.dtype).view(chunk.shape).copy_(chunk),
                                   lambda slots, chunk=chunk, out=out: _sum(slots, chunk, out, row)))
    return works[-1]


def _sum(slots: List[Tensor], chunk: Tensor, out: Tensor, row: Optional[int]) -> None:
    parts = [slot.view(chunk.dtype).view(chunk.shape) for slot in slots]
    if row is not None:
        parts = [part[row] for part in parts]
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)


def _where() -> tuple:
    """This process's host (name and boot id), architecture, and whether it has /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot, platform.machine().lower(), os.path.isdir("/dev/shm")


def host_comm_unavailable(group, device: torch.device) -> Optional[str]:
    """Why the ranks of ``group`` cannot use shared memory for the runtime's collectives, or None. Every rank gets the
    same answer: what can differ between ranks is gathered from all of them (one collective, on CPU with gloo)."""
    if device.type != "cpu":
        return f"the runtime's device is {device.type}, not cpu"
    if dist.get_backend(group) != "gloo":
        return f"the process group's backend is {dist.get_backend(group)}, not gloo"
    if dist.get_world_size(group) < 2:
        return "there is one rank"
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, _where(), group=group)
    if any(where[:2] != everyone[0][:2] for where in everyone):
        return "the ranks are on more than one host"
    if everyone[0][2] not in ("x86_64", "amd64"):  # host_comm.py's docstring
        return f"its flags rely on x86-64's store order, and this machine is {everyone[0][2]}"
    if not everyone[0][3]:
        return "this host has no /dev/shm"
    return None


def new_token(group) -> str:
    """A name shared by the ranks of ``group`` for the segments they create (rank 0's random choice)."""
    token = [secrets.token_hex(8) if dist.get_rank(group) == 0 else None]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(token, src=src, group=group)
    return token[0]


class HostComm:
    """A runtime's channels: ``gather`` (slots of a gathered chunk's shard; None at ZeRO-1/2) and ``reduce`` (slots
    of a chunk of a gradient bucket)."""

    def __init__(self, group, gather_slot_bytes: int, reduce_slot_bytes: int, gather_slots: int = 8,
                 reduce_slots: int = 4):
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        token = new_token(group)
        self.gather = Channel(group, rank, world_size, gather_slot_bytes, gather_slots, token, "g") \
            if gather_slot_bytes else None
        self.reduce = Channel(group, rank, world_size, reduce_slot_bytes, reduce_slots, token, "r")

    @property
    def bytes(self) -> int:
        return self.reduce.bytes + (self.gather.bytes if self.gather is not None else 0)


def open_host_comm(mode: str, group, device: torch.device, gather_slot_bytes: int,
                   reduce_slot_bytes: int) -> Optional[HostComm]:
    """``compile.host_comm``: ``"gloo"`` None; ``"shm"`` shared memory or a ``ValueError`` saying why not; ``"auto"``
    shared memory where every rank is on this host (CPU, gloo, x86-64), else None. ``gather_slot_bytes`` 0: no
    gather channel."""
    if mode not in HOST_COMM_MODES:
        raise ValueError(f"compile.host_comm: {mode!r} is not one of {', '.join(HOST_COMM_MODES)}")
    if mode == "gloo":
        return None
    reason = host_comm_unavailable(group, device)
    if reason is not None:
        if mode == "shm":
            raise ValueError(f"compile.host_comm='shm' cannot be used: {reason}")
        return None
    return HostComm(group, gather_slot_bytes, reduce_slot_bytes)

# SPDX-License-Identifier: Apache-2.0
"""The shared-memory segments behind ``compile.host_comm`` (``host_comm.py`` lays its channels out in them): which
ranks may use them, their set-up as one step the ranks agree on, and each rank's liveness and state.

Each rank's segment is a file in ``compile.host_comm_dir`` (``/dev/shm`` by default) that starts with a control page:
a token and the rank that made it (checked by every peer that maps it), the rank's state (open, closed, or failed
with a message its peers read), and the lock its process holds on the file while it lives. ``docs/design.md``
("Collectives through shared memory") says what the set-up guarantees.
"""
import datetime
import errno
import fcntl
import mmap
import os
import platform
import secrets
import socket
from typing import Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist

DEFAULT_DIR = "/dev/shm"
PAGE = 4096
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # page tables filled at set-up
# a process group whose timeout cannot be read: torch.distributed's default
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
# the control page: int64 words, then the failure message a rank posts
_TOKEN, _RANK, _STATE, _MESSAGE_LEN = range(4)
_MESSAGE_AT, _MESSAGE_MAX = 64, 2048
OPEN, CLOSED, FAILED = 0, 1, 2


class SetUpError(RuntimeError):
    """The segments could not be set up on some rank: every rank raises it, with the same message."""


def _where(directory: str) -> tuple:
    """This process's host (name and boot id), architecture, and whether it has the segments' directory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot, platform.machine().lower(), os.path.isdir(directory)


def host_comm_unavailable(group, device: torch.device, directory: str = DEFAULT_DIR) -> Optional[str]:
    """Why the ranks of ``group`` cannot use shared memory for the runtime's collectives, as far as the ranks' host,
    architecture and directory tell, or None. Every rank gets the same answer: what can differ between ranks is
    gathered from all of them (one collective, on CPU with gloo)."""
    if device.type != "cpu":
        return f"the runtime's device is {device.type}, not cpu"
    if dist.get_backend(group) != "gloo":
        return f"the process group's backend is {dist.get_backend(group)}, not gloo"
    if dist.get_world_size(group) < 2:
        return "there is one rank"
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, _where(directory), group=group)
    if any(where[:2] != everyone[0][:2] for where in everyone):
        return "the ranks are on more than one host"
    if everyone[0][2] not in ("x86_64", "amd64"):  # the module docstring
        return f"its flags rely on x86-64's store order, and this machine is {everyone[0][2]}"
    missing = [r for r, where in enumerate(everyone) if not where[3]]
    if missing:
        return f"{directory} is not a directory on rank {missing[0]} (compile.host_comm_dir)"
    return None


def new_token(group) -> str:
    """A name shared by the ranks of ``group`` for the segments they create (rank 0's random choice)."""
    token = [secrets.token_hex(8) if dist.get_rank(group) == 0 else None]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(token, src=src, group=group)
    return token[0]


def group_timeout(group) -> datetime.timedelta:
    """The process group's own collective timeout (what gloo's collectives on it wait), else torch's default."""
    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return _DEFAULT_TIMEOUT


def _agree(group, problem: Optional[str]) -> Optional[str]:
    """Every rank's ``problem`` gathered (one collective): the first rank's that has one, named, or None."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problem, group=group)
    return next((f"rank {r}: {p}" for r, p in enumerate(everyone) if p is not None), None)


class Segments:
    """This rank's segment file and every rank's mapping of theirs. Closing unmaps what it can and closes the files
    (which releases the lock that tells peers this process lives); the file itself is unlinked once every rank has
    mapped it, or on any failure before."""

    def __init__(self, path: str):
        self.path: Optional[str] = path  # until unlinked
        self.fds: List[int] = []  # per rank once opened; this rank's first
        self.maps: List[mmap.mmap] = []
        self.own_fd = -1
        self.failed = False  # a failure posted: closing keeps it for the peers to read
        self.control: Optional[List[np.ndarray]] = None  # every rank's control page, once set up

    def unlink(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = None

    def set_state(self, state: int, message: str = "") -> None:
        """Written with the file, not the mapping: works while views of the mapping are still alive."""
        if self.own_fd < 0:
            return
        data = message.encode()[:_MESSAGE_MAX]
        if state == FAILED:
            self.failed = True
        elif self.failed:
            return
        try:
            if data:
                os.pwrite(self.own_fd, data, _MESSAGE_AT)
                os.pwrite(self.own_fd, np.array([len(data)], dtype=np.int64).tobytes(), _MESSAGE_LEN * 8)
            os.pwrite(self.own_fd, np.array([state], dtype=np.int64).tobytes(), _STATE * 8)
        except OSError:
            pass

    @classmethod
    def set_up(cls, group, directory: str, size: int) -> "Segments":
        """Every rank's segment of ``size`` bytes in ``directory``, mapped by every rank: created with its space
        reserved, written, locked; agreed by every rank (one collective); every peer's opened, mapped and its token
        checked; agreed again; then unlinked. Any failure on any rank: every rank releases what it made, and all raise
        :class:`SetUpError` naming the first rank that failed and why."""
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        hex_token = new_token(group)
        token = int(hex_token[:15], 16)
        paths = [os.path.join(directory, f"dsc_{hex_token}_{r}") for r in range(world_size)]
        segments = cls(paths[rank])
        try:
            problem = _agree(group, _attempt(lambda: _create(segments, size, token, rank))) or \
                _agree(group, _attempt(lambda: _map_peers(segments, paths, size, token, rank)))
        except BaseException:
            segments.close()
            raise
        if problem is not None:
            segments.close()
            raise SetUpError(problem)
        segments.unlink()  # every rank has mapped every segment: the names can go
        segments.control = [np.frombuffer(m, dtype=np.int64, count=4) for m in segments.maps]
        return segments

    def state(self, r: int) -> int:
        """Rank ``r``'s state: OPEN, CLOSED or FAILED."""
        return int(self.control[r][_STATE])

    def message(self, r: int) -> str:
        """The failure rank ``r`` posted."""
        n = min(int(self.control[r][_MESSAGE_LEN]), _MESSAGE_MAX)
        return bytes(self.maps[r][_MESSAGE_AT:_MESSAGE_AT + n]).decode(errors="replace")

    def gone(self, r: int) -> bool:
        """Whether rank ``r``'s process has ended: the kernel released the lock it held on its segment (this needs
        nothing of the peer, which may have been killed)."""
        fd = self.fds[r]
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True

    def close(self) -> None:
        self.control = None
        self.unlink()
        self.set_state(CLOSED)
        for m in self.maps:
            try:
                m.close()
            except BufferError:  # views still alive elsewhere: unmapped when they go
                pass
        self.maps = []
        for fd in self.fds + ([self.own_fd] if self.own_fd >= 0 and self.own_fd not in self.fds else []):
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds, self.own_fd = [], -1


def _create(segments: Segments, size: int, token: int, rank: int) -> None:
    """This rank's segment: created, its space reserved, its control page written, locked for life."""
    directory = os.path.dirname(segments.path)
    free = os.statvfs(directory)
    available = free.f_bavail * free.f_frsize
    if available < size:
        raise OSError(errno.ENOSPC, f"{directory} has {available >> 20} MiB free and a segment needs {size >> 20} MiB "
                                    "(a container's /dev/shm is often 64 MiB: docker run --shm-size)")
    fd = os.open(segments.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    segments.own_fd = fd
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        raise OSError(err.errno, f"reserving {size >> 20} MiB in {directory} failed ({os.strerror(err.errno)}; a "
                                 "container's /dev/shm is often 64 MiB: docker run --shm-size)") from err
    os.pwrite(fd, np.array([token, rank, OPEN, 0], dtype=np.int64).tobytes(), 0)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this process lives: peers test it (gone)


def _map_peers(segments: Segments, paths: List[str], size: int, token: int, rank: int) -> None:
    for r, path in enumerate(paths):
        fd = segments.own_fd if r == rank else os.open(path, os.O_RDWR)
        if r != rank:
            segments.fds.append(fd)
        if os.fstat(fd).st_size != size:
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, not the {size} rank {r} made")
        segments.maps.append(mmap.mmap(fd, size, flags=_MAP_FLAGS))
        head = np.frombuffer(segments.maps[-1], dtype=np.int64, count=2)
        if (int(head[_TOKEN]), int(head[_RANK])) != (token, r):
            raise OSError(f"{path} is not the segment rank {r} made for this job (another /dev/shm: the ranks share a "
                          "host name but not their shared-memory directory)")
        del head
    # the fds list per rank, this rank's own in its place
    segments.fds.insert(rank, segments.own_fd)


def _attempt(step: Callable[[], None]) -> Optional[str]:
    try:
        step()
        return None
    except OSError as err:
        return str(err) if err.filename is None else f"{err.strerror}: {err.filename}"
    except Exception as err:  # any rank's failure must reach the agreement, or the others would wait for it
        return f"{type(err).__name__}: {err}"

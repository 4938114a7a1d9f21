# SPDX-License-Identifier: Apache-2.0
"""Real tensor-memory measurement of a training step, on CPU as well as on CUDA.

CPU has no allocator statistics, so the live-bytes curve is rebuilt from ``torch.profiler`` memory events
(``profile_memory=True``): every allocation and free made through c10's CPU allocator is reported with its
address and size. Frees that happen on threads the profiler does not watch (gloo's worker threads) are not
reported, so a running total drifts upward. We therefore match allocations to frees *by address*: when a new
block is allocated over an address range that a block we still think is live occupies, that older block must
have been freed in the meantime (the allocator cannot hand out memory that is in use), so it is retired
then. Frees of blocks allocated before profiling started are not reported at all: trace one step *before*
the step of interest as well, so that the step of interest starts with every transient block known (the
worker runs its last two steps in one ``trace_memory()`` window and reads the last with ``step_peak``).

On CUDA, ``torch.cuda.max_memory_allocated`` gives the peak, and the profiler still draws the timeline.

``live_tensor_bytes()`` is the census used as the absolute baseline on CPU: the bytes of all distinct tensor
storages reachable from Python (``gc``). See docs/benchmarks.md for the limits of both.
"""
import bisect
import contextlib
import gc
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch.profiler import ProfilerActivity, profile, record_function

MARK_PREFIX = "bench::"
PAGE_BYTES = 4096


@dataclass
class MemoryTimeline:
    """Live tensor bytes over time, relative to the start of the traced window."""

    times_s: List[float] = field(default_factory=list)  # seconds since the window start
    live_bytes: List[int] = field(default_factory=list)  # bytes allocated in the window and still live
    marks: List[Tuple[str, float, float]] = field(default_factory=list)  # (name, start_s, end_s)
    inferred_frees: int = 0  # frees recovered by address matching (not reported by the profiler)
    # the allocation events behind each point, (ptr, size, what allocated it): size < 0 is a free (live_at_peak)
    events: List[Tuple[int, int, str]] = field(default_factory=list, repr=False)

    def window(self, start_s: float, end_s: float) -> "MemoryTimeline":
        """The part of the timeline in [start_s, end_s], re-based so that it starts at 0 s and 0 bytes."""
        i0 = bisect.bisect_right(self.times_s, start_s)
        base = self.live_bytes[i0 - 1] if i0 > 0 else 0
        out = MemoryTimeline(inferred_frees=self.inferred_frees)
        out.times_s.append(0.0)
        out.live_bytes.append(0)
        for t, b in zip(self.times_s[i0:], self.live_bytes[i0:]):
            if t > end_s:
                break
            out.times_s.append(t - start_s)
            out.live_bytes.append(b - base)
        out.times_s.append(end_s - start_s)
        out.live_bytes.append(out.live_bytes[-1])
        out.marks = [(n, s - start_s, e - start_s) for n, s, e in self.marks if s >= start_s and e <= end_s]
        return out

    @property
    def peak_bytes(self) -> int:
        return max(self.live_bytes, default=0)

    @property
    def end_bytes(self) -> int:
        return self.live_bytes[-1] if self.live_bytes else 0


class _LiveBlocks:
    """Blocks believed live, sorted by address, so that an allocation retires every block it overlaps."""

    def __init__(self):
        self.starts: List[int] = []
        self.sizes: Dict[int, int] = {}
        self.total = 0
        self.inferred_frees = 0

    def free(self, ptr: int) -> bool:
        size = self.sizes.pop(ptr, None)
        if size is None:
            return False
        del self.starts[bisect.bisect_left(self.starts, ptr)]
        self.total -= size
        return True

    def alloc(self, ptr: int, size: int) -> None:
        # Any live block overlapping [ptr, ptr + size) was freed without a report.
        i = bisect.bisect_right(self.starts, ptr) - 1
        if i >= 0 and self.starts[i] + self.sizes[self.starts[i]] <= ptr:
            i += 1
        i = max(i, 0)
        while i < len(self.starts) and self.starts[i] < ptr + size:
            self.free(self.starts[i])
            self.inferred_frees += 1
        bisect.insort(self.starts, ptr)
        self.sizes[ptr] = size
        self.total += size


_ALLOCATING = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
               "aten::zeros", "aten::zeros_like", "aten::new_zeros", "aten::full", "aten::ones_like")


def _allocated_by(ev) -> str:
    """What an allocation was made for: the innermost op above it that is not a bare allocation, the nearest
    enclosing call that is not an aten op (an autograd node, a compiled graph, a graph op), and the innermost
    benchmark mark (``forward``, ``backward``...) it happened in."""
    op, allocation, where, phase = None, None, None, None
    parent = ev.parent
    while parent is not None and phase is None:
        name = parent.name
        if name.startswith(MARK_PREFIX):
            phase = name[len(MARK_PREFIX):]
        elif op is None and name in _ALLOCATING:
            allocation = name  # an op that only allocates: named if no op above it does more
        elif op is None and name.startswith("aten::"):
            op = name
        elif where is None and not name.startswith("aten::"):
            where = name
        parent = parent.parent
    op = op or allocation or "?"
    label = f"{op} < {where}" if where else op
    return f"{label} [{phase}]" if phase else label


def _walk(events) -> Iterator:
    stack = list(events)
    while stack:
        ev = stack.pop()
        yield ev
        stack.extend(ev.children)


def timeline_from_profile(prof: profile, device_type: str = "cpu") -> MemoryTimeline:
    """Rebuild live bytes over time from a finished profiler's allocation events on one device type."""
    roots = prof.profiler.kineto_results.experimental_event_tree()
    allocs, marks, t0 = [], [], None
    for ev in _walk(roots):
        t0 = ev.start_time_ns if t0 is None else min(t0, ev.start_time_ns)
        ef = ev.extra_fields
        if type(ef).__name__ == "_ExtraFields_Allocation":
            if ef.device.type == device_type and ef.alloc_size != 0:
                label = _allocated_by(ev) if ef.alloc_size > 0 else ""
                allocs.append((ev.start_time_ns, ef.ptr, ef.alloc_size, label))
        elif ev.name.startswith(MARK_PREFIX):
            marks.append((ev.name[len(MARK_PREFIX):], ev.start_time_ns, ev.end_time_ns))
    allocs.sort(key=lambda a: a[0])
    t0 = t0 or 0
    blocks = _LiveBlocks()
    out = MemoryTimeline()
    for t, ptr, size, label in allocs:
        if size > 0:
            blocks.alloc(ptr, size)
        elif not blocks.free(ptr):
            continue  # a block from before the window: its free is not reported consistently
        out.times_s.append((t - t0) / 1e9)
        out.live_bytes.append(blocks.total)
        out.events.append((ptr, size, label))
    out.marks = sorted((n, (s - t0) / 1e9, (e - t0) / 1e9) for n, s, e in marks)
    out.inferred_frees = blocks.inferred_frees
    return out


def mark(name: str) -> contextlib.AbstractContextManager:
    """A named range (``forward``, ``backward``, ``step``...) that shows up in the timeline's marks."""
    return record_function(MARK_PREFIX + name)


@contextlib.contextmanager
def trace_memory(device_type: str = "cpu") -> Iterator[Dict[str, object]]:
    """Profile the block; on exit the dict holds ``timeline`` (and ``cuda_peak_bytes`` on CUDA)."""
    result: Dict[str, object] = {}
    activities = [ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        result["cuda_start_bytes"] = torch.cuda.memory_allocated()
    with profile(activities=activities, profile_memory=True) as prof:
        yield result
        if device_type == "cuda":
            torch.cuda.synchronize()
    if device_type == "cuda":
        result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    result["timeline"] = timeline_from_profile(prof, device_type)


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of all distinct tensor storages on ``device_type`` that Python can reach (a census, not a peak)."""
    if device_type == "cuda":
        return torch.cuda.memory_allocated()
    gc.collect()
    seen: Dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            continue  # subclasses (fake tensors, DTensor wrappers) own no storage of their own
        try:
            storage = obj.untyped_storage()
            if storage.device.type != device_type or storage.data_ptr() == 0:
                continue
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        except (RuntimeError, NotImplementedError):
            continue
    return sum(seen.values())


def live_at_peak(timeline: MemoryTimeline, step_mark: str, top: int = 12) -> List[Tuple[str, int, int]]:
    """What is live at the peak of the last range named ``step_mark`` (``timeline`` as traced, not a window), of
    what was allocated inside that range: ``(allocated by, bytes, blocks)``, largest first, ``top`` of them and the
    rest summed as ``"(other)"``. The sum is the window's peak above its start (``step_peak(...).peak_bytes``) plus
    what the range freed from before it by then."""
    ranges = [(s, e) for n, s, e in timeline.marks if n == step_mark]
    if not ranges:
        return []
    start, end = ranges[-1]
    first = bisect.bisect_right(timeline.times_s, start)
    last = bisect.bisect_right(timeline.times_s, end)
    if first >= last:
        return []
    peak = max(range(first, last), key=lambda i: timeline.live_bytes[i])
    blocks, labels = _LiveBlocks(), {}
    for i, (ptr, size, label) in enumerate(timeline.events[:peak + 1]):
        if size > 0:
            blocks.alloc(ptr, size)
            labels[ptr] = (label, i >= first)
        else:
            blocks.free(ptr)
    by_label: Dict[str, List[int]] = {}
    for ptr, size in blocks.sizes.items():
        label, inside = labels[ptr]
        if inside:
            entry = by_label.setdefault(label, [0, 0])
            entry[0] += size
            entry[1] += 1
    ranked = sorted(((label, b, n) for label, (b, n) in by_label.items()), key=lambda x: -x[1])
    rest = ranked[top:]
    return ranked[:top] + ([("(other)", sum(b for _, b, _ in rest), sum(n for _, _, n in rest))] if rest else [])


def step_peak(timeline: MemoryTimeline, step_mark: str) -> Optional[MemoryTimeline]:
    """The timeline of the last range named ``step_mark``, re-based to its start."""
    ranges = [(s, e) for n, s, e in timeline.marks if n == step_mark]
    if not ranges:
        return None
    start, end = ranges[-1]
    return timeline.window(start, end)

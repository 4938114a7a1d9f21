# SPDX-License-Identifier: Apache-2.0
"""What a runtime's collectives cost and the order they went out in.

One :class:`CommLog` per runtime (every stage: ``stage.py``), shared by its parts: ZeRO-3's gathers (``z3.py``,
``z3_runs.py``) and gradient reduction (``z3_reduce.py``), ZeRO-1/2's hand-offs (``z12_reduce.py``). It holds the
counters ``engine_report`` reads, the waits (a collective past
``compile.collective_timeout_s`` raises an error naming it), live gathered bytes, and the recordings ``report.py``
switches on (the live-bytes timeline, each collective's span in flight, the collectives in issue order).
"""
import datetime
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ..native.gather import wait_for


@dataclass
class GatherCounters:
    """ZeRO-3's gathers: by the graphs (their ops and coalesced runs) and for eager code (ZeRO-1/2 gather nothing)."""
    gathers: int = 0  # parameters gathered by the graphs
    allgather_collectives: int = 0  # collectives that gathered them (fewer when coalesced)
    allgather_bytes: int = 0
    allgather_bytes_by_dtype: Dict[str, int] = field(default_factory=dict)
    # the graphs' all-gather collectives by the path they took: "shm" (host_comm's slots), "native" (the native op),
    # "python" (torch.distributed called from Python)
    allgather_collectives_by_path: Dict[str, int] = field(default_factory=dict)
    gather_seconds: float = 0.0  # time spent waiting for all-gathers (exposed communication)
    runs_started_ahead: int = 0  # coalesced runs whose collective had been started before they were needed
    shard_copies: int = 0  # copies of offloaded shards to the device (one per run, or per single gather)
    # gathered copies freed with no op having claimed them: a prefetched run's member that no graph used, its
    # collective bytes wasted (0 while the runs' plans name the parameters the graphs run on)
    unclaimed_gathers: int = 0
    eager_gathers: int = 0  # parameters gathered on access by code outside the compiled graphs
    live_gathered_bytes: int = 0
    peak_gathered_bytes: int = 0

    def count_path(self, path: str) -> None:
        self.allgather_collectives_by_path[path] = self.allgather_collectives_by_path.get(path, 0) + 1


@dataclass
class ReduceCounters:
    """Gradient reduction, every stage: ZeRO-3's reduce-scatters, ZeRO-1/2's hand-offs to ZeRO's buckets."""
    reduces: int = 0  # gradients reduced (ZeRO-3) or handed to ZeRO (ZeRO-1/2), from the graphs or eager code
    reduce_collectives: int = 0
    reduce_bytes: int = 0  # bytes sent by gradient reductions, in each gradient's communication dtype
    reduce_scatter_bytes: int = 0  # of those, by ZeRO-3's reduce-scatters
    reduce_wait_seconds: float = 0.0  # time spent waiting for reductions started earlier
    reduces_started_ahead: int = 0  # ZeRO-2 bucket reductions left in flight while backward went on (z12_reduce.py)
    eager_grads: int = 0  # ZeRO-1/2: gradients autograd accumulated from eager code (frames run as Python)
    matmul_grads: int = 0  # ZeRO-1/2: gradients a reduce computed itself, fused with their matmul (reduce_grad_mm)
    grads_in_bucket: int = 0  # of those, computed straight into ZeRO-2's reduce bucket (no copy into it)
    grads_reduced_in_place: int = 0  # ZeRO-3: gradients wider than a bucket, reduced where they lie (no copy)


@dataclass
class Counters:
    """What a runtime's collectives did since the last reset, one type for every stage."""
    gather: GatherCounters = field(default_factory=GatherCounters)
    reduce: ReduceCounters = field(default_factory=ReduceCounters)


@contextmanager
def timeout_named(timeout: Optional[datetime.timedelta], what: Callable[[], str]):
    """A collective past ``timeout`` (``compile.collective_timeout_s``) raises ``TimeoutError`` naming the op and
    parameter (torch's gloo reports a timeout as a RuntimeError with its own text). ``what`` describes the op; it is
    only called then, so the hot path builds no strings."""
    try:
        yield
    except (TimeoutError, RuntimeError) as err:
        if timeout is None or not isinstance(err, TimeoutError) and "imeout" not in str(err) \
                and "timed out" not in str(err).lower():
            raise
        raise TimeoutError(f"deepspeed-compile: {what()} did not complete within {timeout} "
                           f"(compile.collective_timeout_s): a rank did not join it ({err})") from err


class CommLog:

    def __init__(self, timeout_s: float = 0.0):
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s > 0 else None
        self.counters = Counters()
        # (time.perf_counter(), live gathered bytes) at every change, while recording
        self.gathered_timeline: Optional[List[Tuple[float, int]]] = None
        # (kind, issued, waited for) of every collective, while recording: when communication was in flight
        self.collective_spans: Optional[List[Tuple[str, float, float]]] = None
        # (kind, ds_ids of its parameters, elements sent) of every collective issued, in issue order, while
        # recording: every rank must issue the same sequence (a mismatch of equal sizes would not even hang)
        self.issued_collectives: Optional[List[Tuple[str, Tuple[int, ...], int]]] = None
        # called before every collective the runtime starts (the ranks' agreement, runtime/agreement.py)
        self.before_start: Callable[[], None] = lambda: None

    def record(self, on: bool) -> None:
        """Start (clearing what was recorded) or stop the three recordings."""
        self.gathered_timeline = [] if on else None
        self.collective_spans = [] if on else None
        self.issued_collectives = [] if on else None

    def reset_counters(self) -> None:
        live = self.counters.gather.live_gathered_bytes
        self.counters = Counters(GatherCounters(live_gathered_bytes=live, peak_gathered_bytes=live))

    def wait(self, work, what: Callable[[], str]) -> None:
        with self.timeout_named(what):
            wait_for(work, self.timeout)

    def timeout_named(self, what: Callable[[], str]):
        return timeout_named(self.timeout, what)

    def issued(self, kind: str, params, numel: int) -> None:
        if self.issued_collectives is not None:
            self.issued_collectives.append((kind, tuple(p.ds_id for p in params), numel))

    def done(self, kind: str, waited_from: float, issued: Optional[float] = None) -> None:
        """A collective's wait returned: its exposed time (``waited_from`` to now) is counted; while recording, its
        span from issue to the end of its wait is kept."""
        now = time.perf_counter()
        if kind == "all-gather":
            self.counters.gather.gather_seconds += now - waited_from
        else:
            self.counters.reduce.reduce_wait_seconds += now - waited_from
        if self.collective_spans is not None:
            self.collective_spans.append((kind, waited_from if issued is None else issued, now))

    def add_live_bytes(self, nbytes: int, eager: bool = True) -> None:
        """Live gathered bytes change by ``nbytes``: a parameter gathered (> 0) or partitioned (< 0) for eager code,
        or, with ``eager=False``, a gathered copy or a coalesced collective's receive buffer allocated or freed."""
        c = self.counters.gather
        if nbytes > 0 and eager:
            c.eager_gathers += 1
            c.allgather_bytes += nbytes
        c.live_gathered_bytes += nbytes
        c.peak_gathered_bytes = max(c.peak_gathered_bytes, c.live_gathered_bytes)
        if self.gathered_timeline is not None:
            self.gathered_timeline.append((time.perf_counter(), c.live_gathered_bytes))

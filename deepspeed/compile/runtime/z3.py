"""The per-engine ZeRO-3 runtime behind the graph ops.

One :class:`Z3Runtime` per compiled engine owns: the parameter registry (``ds_id`` -> parameter), the
gathered buffers with a reference count each (a parameter gathered by two graphs is gathered once),
live/peak gathered-byte accounting, the bucketed reduce-scatter of gradients into the ZeRO-3 optimizer's
gradient partitions, and communication byte counters. Collectives go through ``torch.distributed`` on the
optimizer's data-parallel group; gloo has no AVG, so gradients are pre-divided and summed (as ZeRO-3 does).
"""
import datetime
import logging
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import Tensor
from torch.nn import Parameter

from ..native.gather import cast_all_gather_python, cast_all_gather_start, load_native, wait_for
from . import registry, standins
from .ops import Run, decode_plan
from .eager_access import EagerAccess

log = logging.getLogger(__name__)

# a run's collective goes out in chunks of about this many gathered elements (see _start_chunks): 2^20 (4 MiB of
# fp32) amortizes a collective's fixed cost and keeps the copy-out transient to a few MiB
GATHER_CHUNK_NUMEL = 1 << 20


@dataclass
class Counters:
    allgather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    gathers: int = 0  # parameters gathered by the graphs
    allgather_collectives: int = 0  # collectives that gathered them (fewer when coalesced)
    reduces: int = 0
    eager_gathers: int = 0  # parameters gathered on access by code outside the compiled graphs
    live_gathered_bytes: int = 0
    peak_gathered_bytes: int = 0
    allgather_bytes_by_dtype: Dict[str, int] = field(default_factory=dict)
    gather_seconds: float = 0.0  # time spent waiting for all-gathers (exposed communication)
    runs_started_ahead: int = 0  # coalesced runs whose collective had been started before they were needed
    reduce_collectives: int = 0
    reduce_bytes: int = 0  # bytes sent by gradient reductions (here all reduce-scatters)
    reduce_wait_seconds: float = 0.0  # time spent waiting for reduce-scatters started earlier


@dataclass
class _Gathered:
    tensor: Tensor
    refs: int
    nbytes: int


@dataclass
class _Bucket:
    buffer: Tensor  # (world_size, columns)
    items: List[Tuple[Parameter, int]] = field(default_factory=list)
    used: int = 0


@dataclass
class _Plan:
    members: Run  # (ds_id, gather dtype or None: its own) of a run
    next: Run  # the following run of the same graph (empty: none), started when this one is waited for


@dataclass
class _Started:
    work: object
    send: Optional[Tensor]  # kept alive until the collective is done
    recv: Optional[Tensor]
    members: List[Parameter]
    dtype: torch.dtype
    issued: float  # time.perf_counter() when the collective was started


@dataclass
class _PendingReduce:
    work: object
    buffer: Tensor  # the bucket buffer it sends from: not reused until the collective is done
    recv: Tensor
    items: List[Tuple[Parameter, int]]
    issued: float


class Z3Runtime:
    stage = 3

    def __init__(self, engine, *, timeout_s: float = 0.0, free_on_release: bool = True, native_op: str = "auto",
                 prefetch_across_graphs: bool = False):
        self.engine = engine
        self.optimizer = engine.optimizer
        self.group = self.optimizer.dp_process_group
        self.world_size = dist.get_world_size(group=self.group)
        self.params: Dict[int, Parameter] = {p.ds_id: p for p in engine.module.parameters() if hasattr(p, "ds_id")}
        # Persistent parameters (DeepSpeed's stage3_param_persistence_threshold) stay gathered across steps, as in
        # eager ZeRO-3: the graphs read them as they are, with no gather or release op, and ZeRO-3's optimizer
        # gathers them again after each step. Only the others are sharded, stood in for and gathered in the graphs.
        self.persistent: List[Parameter] = [p for p in self.params.values() if getattr(p, "ds_persist", False)]
        self.sharded: Dict[int, Parameter] = {i: p for i, p in self.params.items() if not getattr(p, "ds_persist", False)}
        # Eager backend: nothing reuses a freed buffer, so a release frees the storage at once, whoever still holds
        # a Python reference. Inductor frees a buffer right after its last use and may hand its memory to a later
        # buffer ("reuse"): there the release only drops the runtime's reference, never the storage.
        self.free_on_release = free_on_release
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s > 0 else None
        self.bucket_numel = int(engine.zero_reduce_bucket_size())
        # adjacent gathers of a graph go out as one collective of at most this many elements (0: never coalesce)
        self.gather_bucket_numel = int(engine.zero_prefetch_bucket_size())
        # DeepSpeed's stage3_max_reuse_distance: which parameters stay gathered from forward to backward
        # (compile.keep_gathered_bytes="reuse_distance")
        self.max_reuse_distance = int(engine.zero_max_reuse_distance())
        # and how far ahead eager ZeRO-3's prefetcher reaches, which keeps the parameters it passes still gathered
        # (graph/recompute.choose_kept_by_reuse): each module's fetch starts up to a prefetch bucket more, as long as
        # at most stage3_max_live_parameters elements are gathered; without prefetch, nowhere
        self.prefetch_window = int(engine.zero_max_live_parameters()) if self.gather_bucket_numel > 0 else 0
        # the gather runs the graphs have started, by their ``plan`` text, in first-use order (decoded once)
        self.gather_plans: Dict[str, _Plan] = {}
        self._inflight: Dict[Run, List[_Started]] = {}  # a run -> its all-gathers started ahead
        # Across graphs (compile.regions='blocks': one graph per block, so each block's first run would wait): the
        # last run of a graph starts the run that came next in the last step, while this step has followed it
        self.prefetch_across_graphs = prefetch_across_graphs
        self._runs_this_step: List[Run] = []  # every run, in the order this step gathered them
        self._runs_last_step: List[Run] = []
        self._on_last_step = True  # this step has gathered the same runs as the last one so far
        self.input_cast_hook = None  # fp16 auto_cast: the engine's input cast, as a forward pre-hook (init_z3)
        # the columns one reduce of every trained parameter needs: no bucket is ever wider
        self._grad_columns = sum(p.partition_numel() for p in self.params.values() if p.requires_grad)
        # The device the graphs compute on and gather to. ZeRO-3's offload_param keeps the shards elsewhere (the
        # CPU): a gather copies them over first, as eager ZeRO-3 does, and the cast and collective run here.
        self.device = torch.device(engine.device)
        self.shards_offloaded = any(p.ds_tensor.device != self.device for p in self.sharded.values())
        native = load_native(native_op)
        self.gather_path = "native" if native is not None else "python"
        self._cast_all_gather = native or cast_all_gather_python
        # coalesced gathers start through the native op's start form on CUDA, where it casts on the communication
        # stream; on CPU the Python path concatenates and casts the shards in one copy (the op takes one shard, so
        # it would copy the run twice)
        self._native_start = native is not None and self.device.type == "cuda"
        self.counters = Counters()
        # (time.perf_counter(), live gathered bytes) at every change, while recording (report.py)
        self.gathered_timeline: Optional[List[Tuple[float, int]]] = None
        # (kind, issued, waited for) of every collective, while recording: when communication was in flight
        self.collective_spans: Optional[List[Tuple[str, float, float]]] = None
        # (kind, ds_ids of its parameters, elements sent) of every collective this runtime issued, in issue order,
        # while recording: every rank must issue the same sequence (a mismatch of equal sizes would not even hang)
        self.issued_collectives: Optional[List[Tuple[str, Tuple[int, ...], int]]] = None
        self._gathered: Dict[Tuple[int, torch.dtype], _Gathered] = {}
        self._gathered_at: Dict[int, Tuple[int, torch.dtype]] = {}  # a gathered tensor's data_ptr -> its key
        self._gathered_step = engine.global_steps  # the optimizer step the gathered copies hold the weights of
        self._forgotten_at: set = set()  # data_ptrs of copies forgotten by _forget_held (their release: a no-op)
        self._warned_forgotten = False
        self._by_standin: Dict[int, Parameter] = {}  # a stand-in's storage address -> its parameter (param_of)
        self._moved_plans: Dict[Tuple[str, int], Tuple[Run, Run]] = {}  # (plan, first parameter) -> its runs
        self._buckets: Dict[torch.dtype, _Bucket] = {}
        self._bucket_buffers: Dict[torch.dtype, List[Tensor]] = {}
        self._pending_reduces: List[_PendingReduce] = []  # started reduce-scatters, oldest first
        self._backward_pending = False
        self._reduced: set = set()  # ds_ids whose gradient reached the optimizer in this backward
        self._forward_running = False
        self._grad_sources: Dict[int, int] = {}  # ds_id -> uses in this step's forward still owing a gradient
        self._held_grads: Dict[int, Tensor] = {}  # summed gradients of parameters with more uses to come
        names = {p.ds_id: name for name, p in engine.module.named_parameters() if hasattr(p, "ds_id")}
        self.eager = EagerAccess(self.params, names, self.reduce, self._add_live_bytes, self.note_grad_source)
        self._names = names
        self._by_name: Dict[str, Parameter] = {name: self.params[ds_id] for ds_id, name in names.items()}
        self.eager.install_grad_hooks()
        # the parameter dicts ZeRO-3 gathers from on access while marked in forward (see eager_access.py)
        self._param_dicts = [m._parameters for m in engine.module.modules() if hasattr(m._parameters, "_in_forward")]
        # the submodules that own parameters: between forwards each carries two hooks (see _install_outside_hooks)
        self._owners = [m for m in engine.module.modules()
                        if m is not engine.module and any(True for _ in m.parameters(recurse=False))]
        self._outside_hooks: List = []
        self._outside_depth = 0  # nested submodule calls of the outside call running now
        self._outside_exit: Optional[ExitStack] = None
        self._install_outside_hooks()
        self.id = registry.register(self)

    def prefetch_bucket_bytes(self) -> int:
        """``stage3_prefetch_bucket_size`` in bytes of the widest sharded parameter dtype (0 when it is 0)."""
        itemsize = max((p.ds_tensor.element_size() for p in self.sharded.values()), default=0)
        return self.gather_bucket_numel * itemsize

    def reset_counters(self) -> None:
        live = self.counters.live_gathered_bytes
        self.counters = Counters(live_gathered_bytes=live, peak_gathered_bytes=live)

    # ----- parameters ------------------------------------------------------------------------------------
    def param_ds_ids(self, inputs) -> List[Optional[int]]:
        """ds_id of every graph input that is one of this engine's ZeRO-3 parameters (None elsewhere)."""
        return [t.ds_id if isinstance(t, Parameter) and self.sharded.get(getattr(t, "ds_id", None)) is t else None
                for t in inputs]

    def param_of(self, standin: Tensor) -> Parameter:
        """The sharded parameter a graph input stands in for (the ops find their parameter this way, so a graph
        serves any module of the same code): its stand-in's storage, which the parameter's ``.data`` views while
        the graphs run (``standins.install``), whatever wrapper of it the graph was handed."""
        address = standin.untyped_storage().data_ptr()
        param = self._by_standin.get(address)
        if param is None or param.data.untyped_storage().data_ptr() != address:
            self._by_standin = {p.data.untyped_storage().data_ptr(): p for p in self.sharded.values()}
            param = self._by_standin.get(address)
            if param is None:
                raise AssertionError("deepspeed-compile: a graph op was given a tensor that is not the stand-in of "
                                     "a sharded ZeRO-3 parameter of this engine")
        return param

    # ----- gather / release ------------------------------------------------------------------------------
    def _wait(self, work, what: Callable[[], str]) -> None:
        with self._timeout_named(what):
            wait_for(work, self.timeout)

    @contextmanager
    def _timeout_named(self, what: Callable[[], str]):
        """A collective past ``compile.collective_timeout_s`` raises ``TimeoutError`` naming the op and parameter
        (torch's gloo reports a timeout as a RuntimeError with its own text). ``what`` describes the op; it is only
        called then, so the hot path builds no strings."""
        try:
            yield
        except (TimeoutError, RuntimeError) as err:
            if self.timeout is None or not isinstance(err, TimeoutError) and "imeout" not in str(err) \
                    and "timed out" not in str(err).lower():
                raise
            raise TimeoutError(f"deepspeed-compile: {what()} did not complete within {self.timeout} "
                               f"(compile.collective_timeout_s): a rank did not join it ({err})") from err

    def gather(self, standin: Tensor, traced_ds_id: int, dtype: Optional[torch.dtype], plan: str = "") -> Tensor:
        """The ``gather_param`` op: the parameter ``standin`` stands in for, gathered (or its gathered copy shared).
        ``traced_ds_id`` is the parameter the graph was traced with: the graph may run on another module's."""
        param = self.param_of(standin)
        if self._forward_running:
            self.note_grad_source(param)
        if plan:
            self._run_plan(plan, traced_ds_id, param)
        shard = param.ds_tensor
        dtype = dtype or shard.dtype
        key = (param.ds_id, dtype)
        entry = self._gathered.get(key)
        if entry is not None:
            entry.refs += 1
            return entry.tensor
        start = time.perf_counter()
        if self.shards_offloaded:
            shard = shard.to(self.device, non_blocking=True)
        self._note_issued("all-gather", (param,), shard.numel())
        # the shard is cast before it is sent: bf16 moves half the bytes of gathering fp32 and casting after
        with self._timeout_named(lambda: f"the all-gather of parameter {self.eager.name(param)}"):
            flat = self._cast_all_gather(shard, dtype, self.group, self.world_size, self.timeout)
        self._collective_done("all-gather", start)
        self.counters.allgather_collectives += 1
        return self._add_gathered(param, dtype, flat, refs=1)

    def _run_plan(self, text: str, traced_ds_id: int, param: Parameter) -> None:
        """This run's parameters gathered (waiting for the collective started ahead, or one coalesced collective
        now), then the next run's collective started without waiting. Its receive buffer counts as live gathered
        bytes from now on, as the static memory plan counts it (``schedule/memory_plan.in_flight_storages``).
        ``param`` is the run's first parameter, ``traced_ds_id`` the one the graph was traced with."""
        plan = self.gather_plans.get(text)
        if plan is None:
            plan = self.gather_plans[text] = _Plan(*decode_plan(text))
        members, following = plan.members, plan.next
        if param.ds_id != traced_ds_id:  # a graph traced on another module of the same code
            key = (text, param.ds_id)
            if key not in self._moved_plans:
                self._moved_plans[key] = (self._moved(members, traced_ds_id, param),
                                          self._moved(following, traced_ds_id, param))
            members, following = self._moved_plans[key]
        inflight = self._inflight.pop(members, None)
        self.counters.runs_started_ahead += inflight is not None
        if inflight is None:  # nothing started ahead: gather the run now (a lone parameter takes its op's own path)
            inflight = [started for dtype, group in self._missing(members).items() if len(group) > 1
                        for started in self._start_chunks(group, dtype)]
        for started in inflight:  # chunk by chunk: each receive buffer is freed as soon as it is copied out
            self._finish_coalesced(started)
        del inflight
        if self.prefetch_across_graphs:  # every run is recorded; the last of a graph starts the next graph's first
            next_as_last_step = self._next_as_last_step(members)
            following = following or next_as_last_step
        if following and following not in self._inflight:
            self._inflight[following] = [started for dtype, group in self._missing(following).items()
                                         for started in self._start_chunks(group, dtype)]

    def _moved(self, run: Run, traced_ds_id: int, param: Parameter) -> Run:
        """A plan's run, traced on the module that holds ``traced_ds_id``, for the module that holds ``param`` in its
        place: each parameter named under the traced module's path is replaced by the one at the same place under
        the other's (``layers.0.mlp.up.weight`` -> ``layers.3.mlp.up.weight`` when ``layers.0.attn.q.weight`` ran
        as ``layers.3.attn.q.weight``); one outside it (a shared parameter) stays as it is."""
        traced, actual = self._names[traced_ds_id].split("."), self._names[param.ds_id].split(".")
        common = 0
        while common < min(len(traced), len(actual)) and traced[-1 - common] == actual[-1 - common]:
            common += 1
        old, new = ".".join(traced[:len(traced) - common]), ".".join(actual[:len(actual) - common])
        moved = []
        for ds_id, dtype in run:
            name = self._names[ds_id]
            if old and name.startswith(old + "."):
                name = f"{new}.{name[len(old) + 1:]}" if new else name[len(old) + 1:]
            target = self._by_name.get(name)
            if target is None:
                raise AssertionError(f"deepspeed-compile: a gather plan traced on {old or 'the model'} has no "
                                     f"counterpart of {self.eager.name(self.params[ds_id])} under {new or 'the model'}")
            moved.append((target.ds_id, dtype))
        return tuple(moved)

    def _next_as_last_step(self, run: Run) -> Run:
        """The run after ``run`` in the last step, if this step has gathered the same runs so far (every rank runs the
        same graphs in the same order, so every rank starts the same collective at the same point); else none."""
        done, last = self._runs_this_step, self._runs_last_step
        done.append(run)
        i = len(done)
        self._on_last_step = self._on_last_step and i <= len(last) and last[i - 1] == run
        return last[i] if self._on_last_step and i < len(last) else ()

    def _end_of_step(self, learn: bool) -> None:
        """This step's runs become the order the next step prefetches by (``learn``: a training step; an inference
        forward only forgets them)."""
        if learn:
            self._runs_last_step = self._runs_this_step
        self._runs_this_step = []
        self._on_last_step = True

    def _missing(self, run: Run) -> Dict[torch.dtype, List[Parameter]]:
        """The run's parameters not gathered yet, by the dtype they are gathered in (one collective per dtype)."""
        groups: Dict[torch.dtype, List[Parameter]] = {}
        for ds_id, dtype in run:
            param = self.params[ds_id]
            dtype = dtype or param.ds_tensor.dtype
            if (ds_id, dtype) not in self._gathered:
                groups.setdefault(dtype, []).append(param)
        return groups

    def _start_chunks(self, members: List[Parameter], dtype: torch.dtype) -> List["_Started"]:
        """A run's collectives, started: members in order, split into chunks of about ``gather_chunk_numel``
        gathered elements (``GATHER_CHUNK_NUMEL``). Copying a run out of one receive buffer would hold the run twice; chunk by chunk it holds
        the run and one chunk."""
        chunks: List[List[Parameter]] = [[]]
        numel = 0
        for param in members:
            width = param.ds_tensor.numel() * self.world_size
            if chunks[-1] and numel + width > GATHER_CHUNK_NUMEL:
                chunks.append([])
                numel = 0
            chunks[-1].append(param)
            numel += width
        return [self._start_coalesced(chunk, dtype) for chunk in chunks]

    def _start_coalesced(self, members: List[Parameter], dtype: torch.dtype) -> "_Started":
        """One all-gather for several parameters, started: each rank sends its shards back to back, cast first (by the
        native op's start form, or while concatenating them)."""
        shards = [p.ds_tensor.reshape(-1) for p in members]
        if self.shards_offloaded:  # one copy to the device for the run (concatenated where the shards are)
            shards = [torch.cat(shards).to(self.device, non_blocking=True)]
        if self._native_start:  # the op casts into a send buffer of its own: a single shard needs no copy first
            send = shards[0] if len(shards) == 1 else torch.cat(shards)
            work = cast_all_gather_start(send, dtype, self.group, self.world_size, self.timeout)
            recv = work.flat.view(self.world_size, -1)
        else:
            send = torch.empty(sum(s.numel() for s in shards), dtype=dtype, device=shards[0].device)
            torch.cat(shards, out=send)  # the cast, before sending, in the same copy
            recv = torch.empty(self.world_size, send.numel(), dtype=dtype, device=send.device)
            work = dist.all_gather_into_tensor(recv.view(-1), send, group=self.group, async_op=True)
        self.counters.allgather_collectives += 1
        self._note_issued("all-gather", members, send.numel())
        self._add_live_bytes(recv.numel() * recv.element_size(), eager=False)
        return _Started(work, send, recv, members, dtype, time.perf_counter())

    def _finish_coalesced(self, started: "_Started") -> None:
        """Wait for a started all-gather (the exposed part of its time is counted), then copy each parameter out
        of the gathered rows into a buffer of its own, so each is released on its own. They wait, unclaimed, for
        their own gather op."""
        start = time.perf_counter()
        self._wait(started.work,
                   lambda: "the all-gather of parameters " + ", ".join(self.eager.name(p) for p in started.members))
        self._collective_done("all-gather", start, started.issued)
        offset = 0
        for param in started.members:
            width = param.ds_tensor.numel()
            flat = started.recv[:, offset:offset + width].reshape(-1)  # rows -> one contiguous buffer (a copy)
            offset += width
            self._add_gathered(param, started.dtype, flat, refs=0)
        # the receive buffer is freed here (the copies above were live beside it)
        self._add_live_bytes(-started.recv.numel() * started.recv.element_size(), eager=False)
        started.send = started.recv = None

    def _add_gathered(self, param: Parameter, dtype: torch.dtype, flat: Tensor, refs: int) -> Tensor:
        full = flat.narrow(0, 0, param.ds_numel).view(param.ds_shape)
        nbytes = flat.numel() * flat.element_size()
        self._gathered[(param.ds_id, dtype)] = _Gathered(full, refs, nbytes)
        self._gathered_at[full.data_ptr()] = (param.ds_id, dtype)
        self._forgotten_at.discard(full.data_ptr())  # the address of a forgotten copy, freed since and reused
        c = self.counters
        c.gathers += 1
        c.allgather_bytes += nbytes
        c.allgather_bytes_by_dtype[str(dtype)] = c.allgather_bytes_by_dtype.get(str(dtype), 0) + nbytes
        c.live_gathered_bytes += nbytes
        c.peak_gathered_bytes = max(c.peak_gathered_bytes, c.live_gathered_bytes)
        self._record_live()
        return full

    def _drop_unclaimed(self) -> None:
        """Free prefetched parameters whose gather never ran (none should be left: a safety net)."""
        for inflight in self._inflight.values():
            for started in inflight:
                self._finish_coalesced(started)
        self._inflight.clear()
        for key in [k for k, e in self._gathered.items() if e.refs == 0]:
            entry = self._gathered.pop(key)
            self._gathered_at.pop(entry.tensor.data_ptr(), None)
            if self.free_on_release:
                entry.tensor.untyped_storage().resize_(0)
            self.counters.live_gathered_bytes -= entry.nbytes

    def _add_live_bytes(self, nbytes: int, eager: bool = True) -> None:
        """Live gathered bytes change by ``nbytes``: a parameter gathered (> 0) or partitioned (< 0) for eager code,
        or, with ``eager=False``, a coalesced collective's receive buffer allocated or freed."""
        c = self.counters
        if nbytes > 0 and eager:
            c.eager_gathers += 1
            c.allgather_bytes += nbytes
        c.live_gathered_bytes += nbytes
        c.peak_gathered_bytes = max(c.peak_gathered_bytes, c.live_gathered_bytes)
        self._record_live()

    def _collective_done(self, kind: str, waited_from: float, issued: Optional[float] = None) -> None:
        """A collective's wait returned: its exposed time (``waited_from`` to now) is counted; while recording, its
        span from issue to the end of its wait is kept."""
        now = time.perf_counter()
        if kind == "all-gather":
            self.counters.gather_seconds += now - waited_from
        else:
            self.counters.reduce_wait_seconds += now - waited_from
        if self.collective_spans is not None:
            self.collective_spans.append((kind, waited_from if issued is None else issued, now))

    def _note_issued(self, kind: str, params, numel: int) -> None:
        if self.issued_collectives is not None:
            self.issued_collectives.append((kind, tuple(p.ds_id for p in params), numel))

    def _record_live(self) -> None:
        if self.gathered_timeline is not None:
            self.gathered_timeline.append((time.perf_counter(), self.counters.live_gathered_bytes))

    def _forget_stale(self) -> None:
        """Before each forward: gathered copies made before the last optimizer step hold the old weights, and the
        next gather must not share them (:meth:`_forget_held`), nor take a run prefetched before the step."""
        if self.engine.global_steps != self._gathered_step:
            self._gathered_step = self.engine.global_steps
            self._drop_unclaimed()
            self._forget_held()

    def _forget_held(self) -> int:
        """Forget the gathered copies still referenced, and return their bytes. At the end of a backward, and at an
        optimizer step, a copy is referenced only by a forward whose backward never ran (an evaluation that forgot
        ``no_grad``, an output dropped): the parameters its graph keeps for backward are never released. Shared by a
        later gather they would hold the runtime's memory for good and, after an optimizer step, the old weights (a
        later forward trained on them). Forgotten, they are gathered anew when used; their storage goes with the
        autograd graph that saved them (not freed here: a backward of that graph still reads them, and its releases
        are then no-ops)."""
        nbytes = 0
        for key in [k for k, entry in self._gathered.items() if entry.refs > 0]:
            entry = self._gathered.pop(key)
            address = entry.tensor.data_ptr()
            self._gathered_at.pop(address, None)
            self._forgotten_at.add(address)
            nbytes += entry.nbytes
        if nbytes:
            self.counters.live_gathered_bytes -= nbytes
            self._record_live()
        return nbytes

    def release(self, tensor: Tensor, traced_ds_id: int = -1) -> None:
        """The ``release_param`` op: one reference to the gathered parameter ``tensor`` dropped (``traced_ds_id`` is
        not used, as in :meth:`gather`)."""
        address = tensor.data_ptr()
        key = self._gathered_at.get(address)
        if key is None and address in self._forgotten_at:  # a copy forgotten while its graph lived (_forget_held)
            return
        entry = None if key is None or key[1] != tensor.dtype else self._gathered.get(key)
        if entry is None:
            raise AssertionError(f"release of a tensor ({tensor.dtype}, shape {tuple(tensor.shape)}) that is not a "
                                 "gathered parameter")
        entry.refs -= 1
        if entry.refs == 0:
            del self._gathered_at[address]
            if self.free_on_release:
                entry.tensor.untyped_storage().resize_(0)
            del self._gathered[key]
            self.counters.live_gathered_bytes -= entry.nbytes
            self._record_live()

    # ----- gradient reduction ----------------------------------------------------------------------------
    def note_grad_source(self, param: Parameter) -> None:
        """A forward graph (or eager code) used ``param``: one more gradient for it may come in backward."""
        if param.requires_grad:
            self._grad_sources[param.ds_id] = self._grad_sources.get(param.ds_id, 0) + 1

    def reduce_op(self, grad: Tensor, ds_id: int, standin: Optional[Tensor]) -> None:
        """The ``reduce_grad`` op: the gradient of the parameter ``standin`` stands in for. Without one, of parameter
        ``ds_id``: a graph that hands a parameter back as it is gets its gradient as a backward input, with no
        stand-in to name it (such graphs are bound to their traced parameters, ``compiler.make_backend``)."""
        self.reduce(ds_id if standin is None else self.param_of(standin).ds_id, grad)

    def reduce(self, ds_id: int, grad: Tensor) -> None:
        """Queue parameter ``ds_id``'s gradient for the reduce-scatter. A parameter used by several graphs, or by
        a graph and eager code (a tied weight across a graph break), gets one gradient from each: they are summed
        first and reduced once, as autograd's accumulation does for eager ZeRO-3 (same sum, same rounding)."""
        remaining = self._grad_sources.get(ds_id, 0)
        held = self._held_grads.get(ds_id)
        if held is not None:
            held.add_(grad)
        elif remaining > 1:
            held = self._held_grads[ds_id] = grad.detach().clone(memory_format=torch.contiguous_format)
        if remaining > 0:
            self._grad_sources[ds_id] = remaining - 1
        if held is not None:
            if remaining > 1:
                return  # more gradients of this parameter are coming in this backward
            grad = self._held_grads.pop(ds_id)
        self._bucket_grad(ds_id, grad)

    def _bucket_grad(self, ds_id: int, grad: Tensor) -> None:
        """Copy the gradient into the bucket now (a compiled graph may reuse its buffer right after this op);
        reduce-scatter the bucket when the next gradient would not fit."""
        param = self.params[ds_id]
        # the parameter's communication dtype, as eager ZeRO-3 chooses it: under torch_autocast the gradients of
        # lower-precision-safe modules travel in the autocast dtype (half the bytes), the others in their own
        dtype = self.optimizer.get_param_comm_dtype(param)
        width = param.partition_numel()
        bucket = self._buckets.get(dtype)
        if bucket is not None and bucket.used + width > bucket.buffer.shape[1]:
            self._flush(dtype)
            bucket = None
        if bucket is None:
            bucket = _Bucket(self._bucket_buffer(dtype, width, grad.device))
            self._buckets[dtype] = bucket
        # row r of the bucket holds rank r's slice of every gradient (padding stays zero)
        flat = grad.reshape(-1)
        rows = bucket.buffer[:, bucket.used:bucket.used + width]
        full = flat.numel() // width
        rows[:full].copy_(flat[:full * width].view(full, width))
        if full < self.world_size:  # the padded tail of the last shards: the rest of its row, and later rows, are 0
            rest = flat.numel() - full * width
            rows[full, :rest].copy_(flat[full * width:])
            rows[full, rest:].zero_()
            rows[full + 1:].zero_()
        bucket.items.append((param, width))
        bucket.used += width
        self.counters.reduces += 1

    def _bucket_buffer(self, dtype: torch.dtype, width: int, device: torch.device) -> Tensor:
        """A (world_size, columns) buffer, allocated once per dtype and reused (as eager ZeRO-3 keeps its gradient
        bucket). It is never wider than all trained parameters' partitions together, whatever the configured
        ``reduce_bucket_size`` (DeepSpeed's default, 5e8 elements, would be 2 GB of fp32 for any model), and it is
        never zeroed: every gradient writes its columns whole, padding included. A gradient wider than the bucket
        gets a buffer of its own."""
        columns = min(self.bucket_numel // self.world_size, self._grad_columns)
        if width > columns:
            return torch.empty(self.world_size, width, dtype=dtype, device=device)
        busy = {id(pending.buffer) for pending in self._pending_reduces}
        buffers = self._bucket_buffers.setdefault(dtype, [])
        for buffer in buffers:
            if id(buffer) not in busy and buffer.device == device:
                return buffer
        # the other one is still being reduce-scattered: a second buffer (never more: one flush is in flight)
        buffer = torch.empty(self.world_size, columns, dtype=dtype, device=device)
        buffers.append(buffer)
        return buffer

    def _compact(self, bucket: _Bucket) -> Tensor:
        """The used columns of the bucket as one contiguous (world_size * used) buffer, moved to the front of the
        bucket's own storage row by row (a row-sized temporary, not a bucket-sized copy)."""
        buffer, used = bucket.buffer, bucket.used
        flat = buffer.view(-1)
        if used < buffer.shape[1]:
            for r in range(1, self.world_size):
                flat[r * used:(r + 1) * used].copy_(buffer[r, :used].clone())  # clone: the ranges may overlap
        return flat[:self.world_size * used]

    def _flush(self, dtype: torch.dtype) -> None:
        """Start the bucket's reduce-scatter without waiting: it runs while backward goes on, and is finished
        (its partitions handed to the optimizer) at the next flush or at the end of backward."""
        bucket = self._buckets.pop(dtype, None)
        if bucket is None or not bucket.items:
            return
        self._finish_reduces()
        send = self._compact(bucket)
        send.div_(self.world_size)  # gloo has no AVG: pre-divide, then SUM (as eager ZeRO-3 does)
        recv = torch.empty(bucket.used, dtype=dtype, device=send.device)
        work = dist.reduce_scatter_tensor(recv, send.view(-1), group=self.group, async_op=True)
        self.counters.reduce_scatter_bytes += send.numel() * send.element_size()
        self.counters.reduce_bytes += send.numel() * send.element_size()
        self.counters.reduce_collectives += 1
        self._note_issued("reduce-scatter", [param for param, _ in bucket.items], send.numel())
        self._pending_reduces.append(_PendingReduce(work, bucket.buffer, recv, bucket.items, time.perf_counter()))

    def _finish_reduces(self) -> None:
        while self._pending_reduces:
            pending = self._pending_reduces.pop(0)
            start = time.perf_counter()
            self._wait(pending.work, lambda: f"a gradient reduce-scatter ({len(pending.items)} parameters)")
            self._collective_done("reduce-scatter", start, pending.issued)
            self._hand_to_optimizer(pending.items, pending.recv)

    def _hand_to_optimizer(self, items: List[Tuple[Parameter, int]], recv: Tensor) -> None:
        partitions = recv.split([w for _, w in items])
        first, again = [], []
        for (param, _), part in zip(items, partitions):
            (again if param.ds_id in self._reduced else first).append((param, part))
            self._reduced.add(param.ds_id)
        # DeepSpeed's own bookkeeping: copies (first micro-step) or accumulates into the optimizer's partitions
        if first:
            self.optimizer.partition_grads([p for p, _ in first], [g for _, g in first])
        if again:
            # a second gradient for a parameter in this backward (used by a compiled graph and by eager code, e.g.
            # a tied weight): it must add to the first, which DeepSpeed does from its second micro-step on
            micro_step = self.optimizer.micro_step_id
            self.optimizer.micro_step_id = max(micro_step, 1)
            try:
                self.optimizer.partition_grads([p for p, _ in again], [g for _, g in again])
            finally:
                self.optimizer.micro_step_id = micro_step

    # ----- engine hooks ----------------------------------------------------------------------------------
    def detach(self) -> None:
        """The engine returns to eager ZeRO-3: eagerly gathered parameters partitioned, eager ZeRO-3's own gradient
        hooks in charge, stand-ins out (the caller switches ZeRO-3's module hooks back on)."""
        if self.input_cast_hook is not None:
            self.input_cast_hook.remove()
            self.input_cast_hook = None
        self.eager.release()
        self.eager.remove_grad_hooks()
        self._remove_outside_hooks()
        standins.uninstall(self.params.values())

    def prepare_uncompiled(self, params: List[Parameter]) -> None:
        """A graph compiled for other parameters runs uncompiled on these: gather them (see eager_access.py)."""
        self.eager.note_reused_graph()
        for param in params:
            self.eager.gather(param)

    def grad_keys(self, inputs) -> List[Optional[int]]:
        """For every graph input, the ds_id whose gradient the backward graph reduces (the gathered parameters)."""
        return self.param_ds_ids(inputs)

    # ----- calls of submodules outside a forward ---------------------------------------------------------
    # Eager ZeRO-3 gathers a module's parameters whenever the module is called, so code may call a submodule
    # itself between steps: an embedding for ``inputs_embeds``, the backbone of a model with a head,
    # ``model.forward(...)``. Here ZeRO-3's module hooks are off, so between forwards every submodule that owns
    # parameters carries two hooks of ours instead: its call, outermost, runs as a forward of its own (the forward
    # context below: parameters read are gathered on access, their gradients reduced in the next backward, all
    # released after it, or at once under no_grad), uncompiled as in eager ZeRO-3. A module without parameters of
    # its own (a backbone) needs none: the calls it makes are hooked. The compiled forward takes the hooks off
    # first, since dynamo must not trace them, and puts them back after (two hooks per such module and step; the
    # paired step-time benchmarks did not move, docs/capture.md). The root module is not hooked: its compiled call
    # enters the forward context itself (``engine_state.direct_call_context``).
    def _install_outside_hooks(self) -> None:
        if self._outside_hooks:
            return
        for module in self._owners:
            self._outside_hooks.append(module.register_forward_pre_hook(self._outside_call_starts))
            self._outside_hooks.append(module.register_forward_hook(self._outside_call_ends, always_call=True))

    def _remove_outside_hooks(self) -> None:
        for hook in self._outside_hooks:
            hook.remove()
        self._outside_hooks.clear()

    def _outside_call_starts(self, module, args) -> None:
        if self._outside_depth == 0:
            # A backward recomputing a checkpointed module (torch.utils.checkpoint) is part of the step it belongs
            # to. An engine that left DeepCompile (destroyed, or switched off) is detached at its next forward.
            if (self._forward_running or torch._C._current_graph_task_id() != -1
                    or not self.engine.is_deepcompile_active()):
                return
            exit_stack = ExitStack()
            exit_stack.enter_context(self.forward_context(outside=True))
            self._outside_exit = exit_stack
        self._outside_depth += 1

    def _outside_call_ends(self, module, args, output) -> None:
        if self._outside_depth == 0:
            return
        self._outside_depth -= 1
        if self._outside_depth == 0:
            exit_stack, self._outside_exit = self._outside_exit, None
            exit_stack.close()

    @property
    def forward_running(self) -> bool:
        return self._forward_running

    @contextmanager
    def forward_context(self, outside: bool = False):
        """One forward: the compiled model's (through the engine or a direct call of the module), or with
        ``outside`` a submodule called outside any forward."""
        if not outside:
            self._remove_outside_hooks()
        self._forget_stale()
        pending = self._backward_pending  # a forward whose backward has not run yet (this one then runs between)
        # Both are kept across steps, so never made as inference tensors (under an eval's torch.inference_mode): a
        # later training step saves them for backward, which autograd refuses for inference tensors.
        with torch.inference_mode(False):
            absent = [p for p in self.persistent if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            if absent:  # first step, or after something partitioned them (checkpointing): one coalesced gather
                absent[0].all_gather(param_list=absent)
            # Not over parameters gathered for eager code whose backward is still to come (an outside call). An
            # outside call runs uncompiled: a parameter someone holds gathered (GatheredParameters) is read as it is.
            standins.install((p for p in self.sharded.values() if p.ds_id not in self.eager.gathered and not (
                outside and p.ds_status == ZeroParamStatus.AVAILABLE)), self.device)
        for params in self._param_dicts:
            params._in_forward = True  # ZeRO-3 gathers a parameter read outside the graphs (eager_access.py)
        self._forward_running = True
        self.eager.outside = outside
        try:
            with self.eager.activated():
                yield
        except BaseException:
            self.eager.release()
            standins.uninstall(self.params.values())
            raise
        finally:
            self._forward_running = False
            self.eager.outside = False
            for params in self._param_dicts:
                params._in_forward = False
            if not outside:
                self._install_outside_hooks()
        self._backward_pending = pending or torch.is_grad_enabled()
        if not self._backward_pending:  # no backward will come to end this step
            self._end_of_step(learn=False)
            self._drop_unclaimed()
            self._grad_sources.clear()
            self.eager.release()
            standins.uninstall(self.params.values())

    def backward_prologue(self, is_boundary: bool) -> None:
        return None  # accumulation is the optimizer's (micro_step_id); nothing to prepare per backward

    def backward_epilogue(self) -> None:
        if not self._backward_pending:
            return
        for ds_id in sorted(self._held_grads):  # a use whose gradient never came (no grad flowed there)
            self._bucket_grad(ds_id, self._held_grads.pop(ds_id))
        self._grad_sources.clear()
        for dtype in sorted(self._buckets, key=str):
            self._flush(dtype)
        self._finish_reduces()
        # DeepSpeed's epilogue points averaged_gradients at the partitions we filled and ends the micro-step
        self._reduced.clear()
        self._end_of_step(learn=True)
        self._drop_unclaimed()
        self.optimizer.independent_gradient_partition_epilogue()
        self.eager.release()
        standins.uninstall(self.params.values())
        self._backward_pending = False
        forgotten = self._forget_held()
        if forgotten and not self._warned_forgotten:
            self._warned_forgotten = True
            log.warning("deepspeed-compile: a forward ran with grad enabled and its backward did not (an evaluation "
                        "without torch.no_grad()?): the %d gathered bytes its graph keeps for backward stay allocated "
                        "until that graph is freed (eager ZeRO-3 frees its parameters after each module instead). "
                        "Run such forwards under torch.no_grad()", forgotten)
        if self.counters.live_gathered_bytes:
            log.warning("deepspeed-compile: %d gathered bytes still live after backward",
                        self.counters.live_gathered_bytes)

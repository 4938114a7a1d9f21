# SPDX-License-Identifier: Apache-2.0
"""Coalesced, prefetched gathers: the runs of the ZeRO-3 runtime.

The schedule groups gathers that sit next to each other in a graph into runs of up to
``stage3_prefetch_bucket_size`` elements and gives each run's first ``gather_param`` op a plan: the run's parameters
and the run after it (``ops.encode_plan``). A run goes out as one collective per gather dtype (split into chunks),
and when its first op runs, the next run's collective is started without waiting, so one run is in flight ahead of
its use. A graph may serve another module of the same code (``regions: "blocks"``): its plans then name the traced
module's parameters and are moved to the module it runs on. With ``prefetch_across_graphs`` each step's runs are
recorded, and the last run of a graph starts the run that came next in the last step.

Where every rank is on this host (``compile.host_comm``, ``host_comm.py``), a run's shards go into a shared-memory slot
and each parameter is copied straight out of every rank's slot into its own buffer. Otherwise a run's collective
receives into one buffer of rows (rank x the run's shards), and each parameter is copied out of its columns when the
run is waited for. Not gloo's coalesced form (``ProcessGroup.all_gather_single_coalesced``), which
would receive straight into each parameter's own buffer and save that copy: gloo corrupts the process's heap when it
runs that form while another collective of the group is in flight (glibc aborts, "malloc(): unaligned tcache chunk
detected"), and a run started ahead is always in flight beside a gradient reduce or another run. Reproduced in a few
seconds on 2 CPU ranks by ``benchmarks/gloo_collectives.py --race 60`` (the plain all-gather survives the same load).
"""
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from ..native.gather import cast_all_gather_start, wait_for
from .comm import CommLog
from .host_comm import start_gather
from .ops import Run, decode_plan
from .transport import Transport
from .z3_buffers import GatheredBuffers
from .z3_params import ShardedParams

# a run's collective goes out in chunks of about this many gathered elements (see _start_chunks): 2^20 (4 MiB of
# fp32) amortizes a collective's fixed cost and keeps the copy-out transient to a few MiB
GATHER_CHUNK_NUMEL = 1 << 20


def shard_state(param: Parameter) -> Tuple[int, int]:
    """What a gathered copy of ``param`` was gathered from: its shard's address and version counter. Anything that
    writes the shard in place (ZeRO-3's partition of an updated parameter: ``GatheredParameters`` with a
    ``modifier_rank``, ``load_state_dict`` inside it) or replaces it changes this."""
    return param.ds_tensor.data_ptr(), param.ds_tensor._version


@dataclass
class Plan:
    members: Run  # (ds_id, gather dtype or None: its own) of a run
    next: Run  # the following run of the same graph (empty: none), started when this one is waited for


@dataclass
class _Started:
    work: object
    send: Tensor  # kept alive until the collective is done
    recv: Optional[Tensor]  # the rows received (world size x the members' shards); None through shared memory
    members: List[Parameter]
    shards: List[Tuple[int, int]]  # the members' shard_state when it was started
    dtype: torch.dtype
    issued: float  # time.perf_counter() when the collective was started
    nbytes: int  # gathered bytes, counted live from the start to the end of the copies out
    flats: Optional[List[Tensor]] = None  # through shared memory: each member's buffer, filled by the wait


class GatherRuns:
    """Owns the runs' plans, the collectives started ahead and the order of the last step's runs. It gathers the
    ``table``'s parameters through the ``transport`` and hands each gathered copy over to ``buffers``, unclaimed (its
    ``gather_param`` op claims it), with the ``shard_state`` it was gathered from; ``is_gathered((ds_id, dtype))``
    says whether a copy exists already (in ``buffers``, or held gathered for eager code)."""

    def __init__(self, table: ShardedParams, transport: Transport, comm: CommLog, buffers: GatheredBuffers,
                 is_gathered: Callable[[Tuple[int, torch.dtype]], bool], prefetch_across_graphs: bool):
        self.table, self.transport, self.comm, self.buffers = table, transport, comm, buffers
        self._is_gathered = is_gathered
        self.prefetch_across_graphs = prefetch_across_graphs
        # the runs the graphs have started, by their ``plan`` text, in first-use order (decoded once)
        self.plans: Dict[str, Plan] = {}
        self._inflight: Dict[Run, List[_Started]] = {}  # a run -> its all-gathers started ahead
        self._moved_plans: Dict[Tuple[str, int], Tuple[Run, Run]] = {}  # (plan, first parameter) -> its runs
        self._runs_this_step: List[Run] = []  # every run, in the order this step gathered them
        self._runs_last_step: List[Run] = []
        self._on_last_step = True  # this step has gathered the same runs as the last one so far

    def run(self, text: str, traced_ds_id: int, param: Parameter) -> None:
        """This run's parameters gathered (waiting for the collective started ahead, or one coalesced collective
        now), then the next run's collective started without waiting. Its receive buffer counts as live gathered
        bytes from now on, as the static memory plan counts it (``schedule/memory_plan.in_flight_storages``).
        ``param`` is the run's first parameter, ``traced_ds_id`` the one the graph was traced with."""
        plan = self.plans.get(text)
        if plan is None:
            plan = self.plans[text] = Plan(*decode_plan(text))
        members, following = plan.members, plan.next
        if param.ds_id != traced_ds_id:  # a graph traced on another module of the same code
            key = (text, param.ds_id)
            if key not in self._moved_plans:
                self._moved_plans[key] = (self._moved(members, traced_ds_id, param),
                                          self._moved(following, traced_ds_id, param))
            members, following = self._moved_plans[key]
        inflight = self._inflight.pop(members, None)
        self.comm.counters.gather.runs_started_ahead += inflight is not None
        if inflight is None:  # nothing started ahead: gather the run now (a lone parameter takes its op's own path)
            inflight = [started for dtype, group in self._missing(members).items() if len(group) > 1
                        for started in self._start_chunks(group, dtype)]
        for started in inflight:  # chunk by chunk: each receive buffer is freed as soon as it is copied out
            self._finish(started)
        del inflight
        if self.prefetch_across_graphs:  # every run is recorded; the last of a graph starts the next graph's first
            next_as_last_step = self._next_as_last_step(members)
            following = following or next_as_last_step
        if following and following not in self._inflight:
            self._inflight[following] = [started for dtype, group in self._missing(following).items()
                                         for started in self._start_chunks(group, dtype)]

    def gather_one(self, param: Parameter, dtype: torch.dtype) -> Tensor:
        """One parameter gathered by a collective of its own (a run of one, its op's own path), cast first: bf16 moves
        half the bytes of gathering fp32 and casting after. Returns its flat gathered elements, padding included."""
        transport, counters, shard = self.transport, self.comm.counters.gather, param.ds_tensor
        self.comm.before_start()
        start = time.perf_counter()
        if self.table.offloaded:
            shard = shard.to(transport.device, non_blocking=True)
            counters.shard_copies += 1
        self.comm.issued("all-gather", (param, ), shard.numel())
        with self.comm.timeout_named(lambda: f"the all-gather of parameter {self.table.name(param)}"):
            if transport.host is not None:  # cast into this rank's slot, every rank's slot copied out
                (flat, ), work = start_gather(transport.host.gather, [shard.reshape(-1)], dtype, ident=param.ds_id)
                wait_for(work, self.comm.timeout)
            else:
                flat = transport.cast_all_gather(shard, dtype, transport.group, transport.world_size,
                                                 self.comm.timeout)
        self.comm.done("all-gather", start)
        counters.allgather_collectives += 1
        counters.count_path(transport.kind if transport.host is not None else transport.gather_op)
        return flat

    @property
    def last_step(self) -> List[Run]:
        """The runs the last training step gathered, in order (recorded with ``prefetch_across_graphs`` only)."""
        return list(self._runs_last_step)

    def end_of_step(self, learn: bool) -> None:
        """This step's runs become the order the next step prefetches by (``learn``: a training step; an inference
        forward only forgets them)."""
        if learn:
            self._runs_last_step = self._runs_this_step
        self._runs_this_step = []
        self._on_last_step = True

    @property
    def has_inflight(self) -> bool:
        return bool(self._inflight)

    def finish_inflight(self) -> None:
        """Every run started ahead, received and handed over (unclaimed: a run that was never used)."""
        for inflight in self._inflight.values():
            for started in inflight:
                self._finish(started)
        self._inflight.clear()

    def _moved(self, run: Run, traced_ds_id: int, param: Parameter) -> Run:
        """A plan's run, traced on the module that holds ``traced_ds_id``, for the module that holds ``param`` in its
        place: each parameter named under the traced module's path is replaced by the one at the same place under
        the other's (``layers.0.mlp.up.weight`` -> ``layers.3.mlp.up.weight`` when ``layers.0.attn.q.weight`` ran
        as ``layers.3.attn.q.weight``); one outside it (a shared parameter) stays as it is."""
        names = self.table.names
        traced, actual = names[traced_ds_id].split("."), names[param.ds_id].split(".")
        common = 0
        while common < min(len(traced), len(actual)) and traced[-1 - common] == actual[-1 - common]:
            common += 1
        old, new = ".".join(traced[:len(traced) - common]), ".".join(actual[:len(actual) - common])
        moved = []
        for ds_id, dtype in run:
            name = names[ds_id]
            if old and name.startswith(old + "."):
                name = f"{new}.{name[len(old) + 1:]}" if new else name[len(old) + 1:]
            target = self.table.by_name.get(name)
            if target is None:
                raise AssertionError(f"deepspeed-compile: a gather plan traced on {old or 'the model'} has no "
                                     f"counterpart of {self.table.name(self.table.params[ds_id])} under {new or 'the model'}")
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

    def _missing(self, run: Run) -> Dict[torch.dtype, List[Parameter]]:
        """The run's parameters not gathered yet, by the dtype they are gathered in (one collective per dtype)."""
        groups: Dict[torch.dtype, List[Parameter]] = {}
        for ds_id, dtype in run:
            param = self.table.params[ds_id]
            dtype = dtype or param.ds_tensor.dtype
            if not self._is_gathered((ds_id, dtype)):
                groups.setdefault(dtype, []).append(param)
        return groups

    def _start_chunks(self, members: List[Parameter], dtype: torch.dtype) -> List[_Started]:
        """A run's collectives, started: members in order, split into chunks of about ``GATHER_CHUNK_NUMEL``
        gathered elements. Copying a run out of one receive buffer would hold the run twice; chunk by chunk it
        holds the run and one chunk."""
        chunks: List[List[Parameter]] = [[]]
        numel = 0
        for param in members:
            width = param.ds_tensor.numel() * self.transport.world_size
            if chunks[-1] and numel + width > GATHER_CHUNK_NUMEL:
                chunks.append([])
                numel = 0
            chunks[-1].append(param)
            numel += width
        return [self._start(chunk, dtype) for chunk in chunks]

    def _start(self, members: List[Parameter], dtype: torch.dtype) -> _Started:
        """One all-gather for several parameters, started: each rank sends its shards, cast first (by the native op's
        start form, or by the copy that concatenates them)."""
        self.comm.before_start()
        states = [shard_state(p) for p in members]
        shards = [p.ds_tensor.reshape(-1) for p in members]
        widths = [s.numel() for s in shards]
        joined = None  # the shards back to back, where that costs no copy of its own
        transport, world_size = self.transport, self.transport.world_size
        if self.table.offloaded:  # one copy to the device for the run (concatenated where the shards are)
            joined = torch.cat(shards).to(transport.device, non_blocking=True)
            shards = list(joined.split(widths))
            self.comm.counters.gather.shard_copies += 1
        elif len(shards) == 1:
            joined = shards[0]
        width = sum(widths)
        flats = None
        if transport.host is not None:  # cast into this rank's slot as the shards are joined; read out per parameter
            path, send, recv = "shm", None, None
            flats, work = start_gather(transport.host.gather, shards, dtype, ident=members[0].ds_id)
        elif transport.native_start:  # the op casts into a send buffer of its own: joined shards need no copy first
            path, send = "native", joined if joined is not None else torch.cat(shards)
            work = cast_all_gather_start(send, dtype, transport.group, world_size, self.comm.timeout)
            recv = work.flat.view(world_size, -1)
        else:  # not gloo's coalesced form into each parameter's buffer: it corrupts the heap (module docstring)
            path = "python"
            send = torch.empty(sum(s.numel() for s in shards), dtype=dtype, device=shards[0].device)
            torch.cat(shards, out=send)  # the cast, before sending, in the same copy
            recv = torch.empty(world_size, send.numel(), dtype=dtype, device=send.device)
            work = dist.all_gather_single(recv.view(-1), send, group=transport.group, async_op=True)
        self.comm.counters.gather.allgather_collectives += 1
        self.comm.counters.gather.count_path(path)
        self.comm.issued("all-gather", members, width)
        nbytes = width * world_size * dtype.itemsize
        self.comm.add_live_bytes(nbytes, eager=False)
        return _Started(work, send, recv, members, states, dtype, time.perf_counter(), nbytes, flats)

    def _finish(self, started: _Started) -> None:
        """Wait for a started all-gather (the exposed part of its time is counted), then hand each parameter's gathered
        buffer over, unclaimed, to wait for its own gather op: a copy of its columns of the received rows (of every
        rank's slot), so that each is released on its own."""
        start = time.perf_counter()
        self.comm.wait(started.work,
                       lambda: "the all-gather of parameters " + ", ".join(self.table.name(p) for p in started.members))
        self.comm.done("all-gather", start, started.issued)
        flats = started.flats  # through shared memory: filled by the wait
        if flats is None:  # rows -> one contiguous buffer a parameter (a copy each)
            flats = _columns(started.recv, [param.ds_tensor.numel() for param in started.members])
        for param, shard, flat in zip(started.members, started.shards, flats):
            self.buffers.add(param, started.dtype, flat, 0, shard)
        # the receive buffer is freed here (the copies above were live beside it)
        self.comm.add_live_bytes(-started.nbytes, eager=False)
        started.send = started.recv = started.work = started.flats = None


def _columns(rows: Tensor, widths: List[int]) -> List[Tensor]:
    """Each parameter's gathered buffer: its columns of every rank's row of ``rows`` (world size, run), side by side."""
    flats, offset = [], 0
    for width in widths:
        flats.append(torch.cat([row[offset:offset + width] for row in rows]))
        offset += width
    return flats

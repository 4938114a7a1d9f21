# SPDX-License-Identifier: Apache-2.0
"""The per-engine ZeRO-3 runtime behind the graph ops.

One :class:`Z3Runtime` per compiled engine. It coordinates its parts, each owning one thing:

- ``shards`` (:class:`~.z3_params.ShardedParams`): the parameters by ``ds_id`` and name, and which one a graph input
  stands in for;
- ``buffers`` (:class:`~.z3_buffers.GatheredBuffers`): each gathered copy, shared by reference count, and its
  lifetime;
- ``runs`` (:class:`~.z3_runs.GatherRuns`): coalesced runs of gathers and their prefetch;
- ``reducer`` (:class:`~.z3_reduce.GradientReducer`): the bucketed reduce-scatter of gradients into the ZeRO-3
  optimizer's partitions;
- ``eager`` (:class:`~.eager_access.EagerAccess`): eager code's access to parameters;
- ``outside`` (:class:`~.z3_outside.OutsideCalls`): submodules called outside any forward;
- and, as every stage (``stage.py``): the ``transport``, the ``comm`` log, the ``peers`` and the step's ``phase``.

This class does what one forward and one backward do around the graphs: stand-ins in, persistent parameters
gathered, copies a step left behind forgotten, everything put back for eager ZeRO-3 when the step's backward ends.
"""
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import Tensor
from torch.nn import Parameter

from ..native.gather import load_native
from . import standins
from .eager_access import EagerAccess
from .host_comm import DEFAULT_DIR, REDUCE_SLOT_BYTES
from .ops import gradient_wanted
from .stage import Phase, StageRuntime
from .transport import Transport
from .z3_buffers import GatheredBuffers, Key
from .z3_outside import OutsideCalls
from .z3_params import ShardedParams
from .z3_reduce import GradientReducer
from .z3_runs import GATHER_CHUNK_NUMEL, GatherRuns, shard_state

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatherSettings:
    """DeepSpeed's ZeRO-3 settings the graphs' gathers and kept parameters follow (read once from the engine)."""
    # adjacent gathers of a graph go out as one collective of at most this many elements (0: never coalesce)
    bucket_numel: int
    # stage3_max_reuse_distance: which parameters stay gathered from forward to backward
    # (compile.keep_gathered_bytes="reuse_distance")
    max_reuse_distance: int
    # how far ahead eager ZeRO-3's prefetcher reaches, which keeps the parameters it passes still gathered
    # (graph/recompute.choose_kept_by_reuse): each module's fetch starts up to a prefetch bucket more, as long as
    # at most stage3_max_live_parameters elements are gathered; without prefetch, nowhere
    prefetch_window: int

    @classmethod
    def of(cls, engine) -> "GatherSettings":
        bucket_numel = int(engine.zero_prefetch_bucket_size())
        return cls(bucket_numel, int(engine.zero_max_reuse_distance()),
                   int(engine.zero_max_live_parameters()) if bucket_numel > 0 else 0)


def _open_transport(engine, shards: ShardedParams, mode: str, directory: str, native_op: str) -> Transport:
    """The runtime's collectives through shared memory where every rank is on this host (compile.host_comm), in
    slots sized by need: a gather slot holds this rank's share of a run's chunk (``GatherRuns._start_chunks``; a
    wider parameter takes several), a reduce slot a chunk of a bucket of every rank's rows, neither more than the
    model has: the sharded parameters for gathers, every trained parameter for reductions (a persistent parameter's
    gradient is reduced like any other)."""
    group = engine.optimizer.dp_process_group
    world_size = torch.distributed.get_world_size(group=group)
    shard_numel, itemsize = shards.shard_numel(), shards.shard_itemsize(default=4)
    return Transport.open(mode, group, torch.device(engine.device),
                          gather_slot_bytes=max(64, min(GATHER_CHUNK_NUMEL // world_size, shard_numel) * itemsize),
                          reduce_slot_bytes=min(REDUCE_SLOT_BYTES, shards.trained_partition_bytes() * world_size),
                          directory=directory, native=load_native(native_op))


class Z3Runtime(StageRuntime):
    stage = 3
    # a frame dynamo runs uncompiled past its recompile limit gathers through ZeRO-3 itself, not the graphs' runs:
    # the ranks agree on it (engine_state._agree_on_recompile_limit)
    agrees_at_recompile_limit = True

    def __init__(self, engine, *, timeout_s: float = 0.0, free_on_release: bool = True, native_op: str = "auto",
                 prefetch_across_graphs: bool = False, host_comm: str = "auto",
                 host_comm_dir: str = DEFAULT_DIR):
        device = torch.device(engine.device)
        self.shards = ShardedParams(engine.module, device)
        super().__init__(engine, _open_transport(engine, self.shards, host_comm, host_comm_dir, native_op), timeout_s)
        self.settings = GatherSettings.of(engine)
        self.buffers = GatheredBuffers(self.comm, free_on_release, engine.global_steps)
        self.reducer = GradientReducer(self.optimizer, self.params, self.transport,
                                       int(engine.zero_reduce_bucket_size()), self.comm)
        self.eager = EagerAccess(self.shards, engine.module, self.reducer.reduce, self.comm.add_live_bytes,
                                 self.reducer.note_source)
        self.runs = GatherRuns(self.shards, self.transport, self.comm, self.buffers, self._has_copy,
                               prefetch_across_graphs)
        self.eager.install_grad_hooks()
        self.outside = OutsideCalls(engine.module, self._outside_forward)
        self.outside.install()
        self._warned_retained = False

    # ----- parameters ------------------------------------------------------------------------------------
    @property
    def params(self) -> Dict[int, Parameter]:
        return self.shards.params

    @property
    def sharded(self) -> Dict[int, Parameter]:
        return self.shards.sharded

    @property
    def persistent(self) -> List[Parameter]:
        return self.shards.persistent

    @property
    def gather_bucket_numel(self) -> int:
        return self.settings.bucket_numel

    def prefetch_bucket_bytes(self) -> int:
        """``stage3_prefetch_bucket_size`` in bytes of the widest sharded parameter dtype (0 when it is 0)."""
        return self.settings.bucket_numel * self.shards.shard_itemsize()

    def param_ds_ids(self, inputs) -> List[Optional[int]]:
        """ds_id of every graph input that is one of this engine's sharded ZeRO-3 parameters (None elsewhere)."""
        return self.shards.ds_ids(inputs)

    def grad_ds_ids(self, inputs) -> List[Optional[int]]:
        """For every graph input, the ds_id whose gradient the backward graph reduces (the gathered parameters)."""
        return self.shards.ds_ids(inputs)

    # ----- gather / release ------------------------------------------------------------------------------
    def gather(self, standin: Tensor, traced_ds_id: int, dtype: Optional[torch.dtype], plan: str = "") -> Tensor:
        """The ``gather_param`` op: the parameter ``standin`` stands in for, gathered (or its gathered copy shared).
        ``traced_ds_id`` is the parameter the graph was traced with: the graph may run on another module's."""
        param = self.shards.param_of(standin)
        if self.forward_running:
            self.reducer.note_source(param)
        # held gathered for eager code in this step (a ZeRO-3 leaf module's parameters all are, when it is entered):
        # copied, with no collective. The graphs inside a leaf module may differ across ranks (experts that got no
        # tokens are not called), so they must issue none of their own.
        held = self.eager.holds(param)
        if plan and not held:
            self.runs.run(plan, traced_ds_id, param)
        shard = param.ds_tensor
        dtype = dtype or shard.dtype
        key = (param.ds_id, dtype)
        shared = self.buffers.take(key)
        if shared is not None:
            return shared
        if held:
            return self._copy_held(param, key)
        gathered_from = shard_state(param)
        return self.buffers.add(param, dtype, self.runs.gather_one(param, dtype), 1, gathered_from)

    def _copy_held(self, param: Parameter, key: Key) -> Tensor:
        """A copy of a parameter eager code holds gathered, in the gather's dtype, freed by its release as a gathered
        copy is. Not the data itself: an op's output may not alias its input, and the parameter is that input."""
        full = param.data.to(key[1], copy=True).reshape(-1)
        return self.buffers.add(param, key[1], full, 1, shard_state(param), collective=False)

    def _has_copy(self, key: Key) -> bool:
        """A run need not gather this (ds_id, dtype): a gathered copy exists, or eager code holds it gathered."""
        return key in self.buffers or self.eager.holds(self.params[key[0]])

    def release(self, tensor: Tensor, traced_ds_id: int = -1) -> None:
        """The ``release_param`` op: one reference to the gathered parameter ``tensor`` dropped (``traced_ds_id`` is
        not used, as in :meth:`gather`)."""
        self.buffers.release(tensor)

    def _drop_unclaimed(self) -> None:
        """Free prefetched parameters whose gather never ran (none should be left: a safety net)."""
        self.runs.finish_inflight()
        self.buffers.forget_unclaimed()

    def _forget_stale(self) -> None:
        """Before each forward: gathered copies that no longer hold their parameter's weights must not be shared by the
        next gather, nor a run prefetched before they changed be taken. After an optimizer step that is every copy
        (z3_buffers.py, "forgotten copies"). Between steps, a forward whose backward has not run (an evaluation that
        forgot ``no_grad``) keeps copies for that backward, and user code may have written a parameter since
        (``GatheredParameters`` with a ``modifier_rank``, ``load_state_dict`` inside it): the copies of the
        parameters whose shard changed are forgotten."""
        if self.engine.global_steps != self.buffers.step:
            self.buffers.step = self.engine.global_steps
            self._drop_unclaimed()
            self.buffers.forget_referenced()
            return
        if not self.buffers.live and not self.runs.has_inflight:
            return  # the common case: the last backward left nothing
        self.runs.finish_inflight()  # into the unclaimed copies, each with the shard it was gathered from
        self.buffers.forget_changed(lambda ds_id: shard_state(self.params[ds_id]))

    # ----- gradient reduction ----------------------------------------------------------------------------
    def reduce_op(self, grad: Tensor, ds_id: int, standin: Optional[Tensor], owned: bool = False) -> None:
        """The ``reduce_grad`` op: the gradient of the parameter ``standin`` stands in for. Without one, of parameter
        ``ds_id``: a graph that hands a parameter back as it is gets its gradient as a backward input, with no
        stand-in to name it (such graphs are bound to their traced parameters, ``compiler.make_backend``).
        ``owned``: nothing else reads the gradient's storage (``ops.run_reduce_owned``)."""
        param = self.params[ds_id] if standin is None else self.shards.param_of(standin)
        if not gradient_wanted(param):  # torch.autograd.grad of other inputs: this gradient is dropped, as autograd's
            return
        # a ZeRO-3 leaf module's parameter is held to the end of backward (EagerAccess.reduce_leaf_grads)
        if not self.eager.hold_leaf_grad(param, grad):
            self.reducer.reduce(param.ds_id, grad, owned)

    # ----- engine hooks ----------------------------------------------------------------------------------
    def detach(self) -> None:
        """The engine returns to eager ZeRO-3: eagerly gathered parameters partitioned, eager ZeRO-3's own gradient
        hooks in charge, stand-ins out (the caller switches ZeRO-3's module hooks back on)."""
        super().detach()
        self.eager.release()
        self.eager.remove_grad_hooks()
        self.outside.remove()
        self.eager.uninstall_forwards()
        standins.uninstall(self.params.values())

    def prepare_uncompiled(self, params: List[Parameter]) -> None:
        """A graph compiled for other parameters runs uncompiled on these: gather them (see eager_access.py)."""
        self.eager.note_reused_graph()
        for param in params:
            self.eager.gather(param)

    def _outside_forward(self):
        """The forward context of a submodule called outside any forward (z3_outside.py), or None where the call is
        part of something running: a forward, a backward recomputing a checkpointed module (torch.utils.checkpoint).
        An engine that left DeepCompile (destroyed, or switched off) is detached at its next forward."""
        if (self.forward_running or torch._C._current_graph_task_id() != -1
                or not self.engine.is_deepcompile_active()):
            return None
        return self.forward_context(outside=True)

    @contextmanager
    def forward_context(self, outside: bool = False):
        """One forward: the compiled model's (through the engine or a direct call of the module), or with
        ``outside`` a submodule called outside any forward."""
        if not outside:
            self.outside.remove()  # dynamo must not trace them
        self._forget_stale()
        # Both are kept across steps, so never made as inference tensors (under an eval's torch.inference_mode): a
        # later training step saves them for backward, which autograd refuses for inference tensors.
        with torch.inference_mode(False):
            absent = [p for p in self.persistent if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            if absent:  # first step, or after something partitioned them (checkpointing): one coalesced gather
                absent[0].all_gather(param_list=absent)
            # Not over parameters gathered for eager code whose backward is still to come (an outside call). An
            # outside call runs uncompiled: a parameter someone holds gathered (GatheredParameters) is read as it is.
            standins.install((p for p in self.sharded.values() if p.ds_id not in self.eager.gathered and not (
                outside and p.ds_status == ZeroParamStatus.AVAILABLE)), self.transport.device)
        self.eager.mark_in_forward(True)  # ZeRO-3 gathers a parameter read outside the graphs (eager_access.py)
        self.eager.outside = outside
        try:
            with self._forward_phase(), self.eager.activated():
                yield
        except BaseException:
            self.eager.release()
            standins.uninstall(self.params.values())
            raise
        finally:
            self.eager.outside = False
            self.eager.mark_in_forward(False)
            if not outside:
                self.outside.install()
        if self.phase is Phase.IDLE:  # no backward will come to end this step
            self.runs.end_of_step(learn=False)
            self._drop_unclaimed()
            self.reducer.forget_sources()
            self.eager.release()
            standins.uninstall(self.params.values())

    def backward_epilogue(self) -> None:
        if not self.backward_owed:
            return
        self.eager.reduce_leaf_grads(self.reducer.bucket_grad)
        self.reducer.end_of_backward()
        self.runs.end_of_step(learn=True)
        self._drop_unclaimed()
        # DeepSpeed's epilogue points averaged_gradients at the partitions we filled and ends the micro-step
        self.optimizer.independent_gradient_partition_epilogue()
        self.eager.release()
        standins.uninstall(self.params.values())
        self.phase = Phase.IDLE
        retained = self.buffers.forget_referenced()
        if retained and not self._warned_retained:
            self._warned_retained = True
            log.warning("deepspeed-compile: a forward ran with grad enabled, its output is still referenced and its "
                        "backward has not run (an evaluation without torch.no_grad() whose loss is kept?): the %d "
                        "gathered bytes its graph keeps for backward stay allocated until that output is freed (eager "
                        "ZeRO-3 frees its parameters after each module instead). Run such forwards under "
                        "torch.no_grad()", retained)
        if self.counters.gather.live_gathered_bytes:
            log.warning("deepspeed-compile: %d gathered bytes still live after backward",
                        self.counters.gather.live_gathered_bytes)

    def report_items(self) -> dict:
        """ZeRO-3's own entries of ``engine_report`` (report.py adds what every stage reports)."""
        c = self.counters.gather
        return {
            # the path the graphs' all-gathers took (several joined by "+"; None before any): "shm" (compile.host_comm),
            # "native" (the native op) or "python"; what compile.native_op loaded is gather_op_loaded
            "gather_path": "+".join(sorted(c.allgather_collectives_by_path)) or None,
            "gather_collectives_by_path": dict(c.allgather_collectives_by_path),
            "gather_op_loaded": self.transport.gather_op,
            "gather_seconds": c.gather_seconds,
            "runs_started_ahead": c.runs_started_ahead,
            "unclaimed_gathers": c.unclaimed_gathers,  # prefetched and never used (wasted collective bytes)
            "shard_copies": c.shard_copies,
            "allgather_bytes": c.allgather_bytes,
            "allgather_bytes_by_dtype": dict(c.allgather_bytes_by_dtype),
            "reduce_scatter_bytes": self.counters.reduce.reduce_scatter_bytes,
            # gradients wider than a bucket that nothing else read, reduced where they lay (no bucket copied them)
            "grads_reduced_in_place": self.counters.reduce.grads_reduced_in_place,
            "gathers": c.gathers,
            "allgather_collectives": c.allgather_collectives,
            "eager_gathers": c.eager_gathers,
            # why dynamo ran code that reads parameters eagerly (its graph breaks), as the warnings named them
            "eager_reasons": list(self.eager.reported),
            "live_gathered_bytes": c.live_gathered_bytes,
            "peak_gathered_bytes": c.peak_gathered_bytes,
        }

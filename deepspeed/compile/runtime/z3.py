# SPDX-License-Identifier: Apache-2.0
"""The per-engine ZeRO-3 runtime behind the graph ops.

One :class:`Z3Runtime` per compiled engine owns: the parameter registry (``ds_id`` -> parameter), the
gathered buffers with a reference count each (a parameter gathered by two graphs is gathered once), what one
forward and backward do around the graphs (stand-ins in, persistent parameters gathered, copies a step left behind
forgotten), and the hooks that run submodules called outside a forward. Its parts: coalesced, prefetched runs of
gathers (``z3_runs.py``), the bucketed reduce-scatter of gradients into the ZeRO-3 optimizer's gradient partitions
(``z3_reduce.py``), eager code's access to parameters (``eager_access.py``), and the counters and recordings of
its collectives (``comm.py``). Collectives go through ``torch.distributed`` on the optimizer's data-parallel group.
"""
import logging
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn import Parameter

from ..native.gather import cast_all_gather_python, load_native, wait_for
from . import registry, standins
from .agreement import Peers
from .comm import CommLog, Counters
from .host_comm import DEFAULT_DIR, REDUCE_SLOT_BYTES, open_host_comm, start_gather
from .eager_access import (EagerAccess, install_forwards_gathering_returned,
                           uninstall_forwards_gathering_returned)
from .ops import gradient_wanted
from .z3_reduce import GradientReducer
from .z3_runs import GATHER_CHUNK_NUMEL, GatherRuns, shard_state

log = logging.getLogger(__name__)


@dataclass
class _Gathered:
    tensor: Tensor
    refs: int
    nbytes: int
    shard: Tuple[int, int]  # the parameter's shard_state it was gathered from


class Z3Runtime(Peers):
    stage = 3

    def __init__(self, engine, *, timeout_s: float = 0.0, free_on_release: bool = True, native_op: str = "auto",
                 prefetch_across_graphs: bool = False, host_comm: str = "auto",
                 host_comm_dir: str = DEFAULT_DIR):
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
        self.comm = CommLog(timeout_s)
        self.agree_timeout = self.comm.timeout
        self.comm.before_start = self.before_collective
        # adjacent gathers of a graph go out as one collective of at most this many elements (0: never coalesce)
        self.gather_bucket_numel = int(engine.zero_prefetch_bucket_size())
        # DeepSpeed's stage3_max_reuse_distance: which parameters stay gathered from forward to backward
        # (compile.keep_gathered_bytes="reuse_distance")
        self.max_reuse_distance = int(engine.zero_max_reuse_distance())
        # and how far ahead eager ZeRO-3's prefetcher reaches, which keeps the parameters it passes still gathered
        # (graph/recompute.choose_kept_by_reuse): each module's fetch starts up to a prefetch bucket more, as long as
        # at most stage3_max_live_parameters elements are gathered; without prefetch, nowhere
        self.prefetch_window = int(engine.zero_max_live_parameters()) if self.gather_bucket_numel > 0 else 0
        self.input_cast_hook = None  # fp16 auto_cast: the engine's input cast, as a forward pre-hook (init_z3)
        # The device the graphs compute on and gather to. ZeRO-3's offload_param keeps the shards elsewhere (the
        # CPU): a gather copies them over first, as eager ZeRO-3 does, and the cast and collective run here.
        self.device = torch.device(engine.device)
        shards_offloaded = any(p.ds_tensor.device != self.device for p in self.sharded.values())
        native = load_native(native_op)
        # the cast + all-gather compile.native_op loaded; where the graphs' all-gathers went is counted per path
        # (Counters.allgather_collectives_by_path)
        self.gather_op = "native" if native is not None else "python"
        self._cast_all_gather = native or cast_all_gather_python
        self._gathered: Dict[Tuple[int, torch.dtype], _Gathered] = {}
        self._gathered_at: Dict[int, Tuple[int, torch.dtype]] = {}  # a gathered tensor's data_ptr -> its key
        self._gathered_step = engine.global_steps  # the optimizer step the gathered copies hold the weights of
        self._forgotten_at: set = set()  # data_ptrs of copies forgotten by _forget_held (their release: a no-op)
        self._warned_forgotten = False
        self._by_standin: Dict[Tuple[int, int], Parameter] = {}  # a stand-in's addresses -> its parameter (param_of)
        self._backward_pending = False
        self._forward_running = False
        names = {p.ds_id: name for name, p in engine.module.named_parameters() if hasattr(p, "ds_id")}
        self._names = names
        # the collectives through shared memory where every rank is on this host (compile.host_comm), in slots sized
        # by need: a gather slot holds this rank's share of a run's chunk (GatherRuns._start_chunks; a wider parameter
        # takes several), a reduce slot a chunk of a bucket of every rank's rows, neither more than the model has
        shard_numel = sum(p.ds_tensor.numel() for p in self.sharded.values())
        itemsize = max([4] + [p.ds_tensor.element_size() for p in self.sharded.values()])
        self.host, self.host_comm_reason = open_host_comm(
            host_comm, self.group, self.device,
            gather_slot_bytes=max(64, min(GATHER_CHUNK_NUMEL // self.world_size, shard_numel) * itemsize),
            reduce_slot_bytes=min(REDUCE_SLOT_BYTES, shard_numel * self.world_size * itemsize), directory=host_comm_dir)
        self.host_comm = "gloo" if self.host is None else "shm"
        self.reducer = GradientReducer(self.optimizer, self.params, self.group, self.world_size,
                                       int(engine.zero_reduce_bucket_size()), self.comm,
                                       host=None if self.host is None else self.host.reduce)
        self.eager = EagerAccess(self.params, names, self.reducer.reduce, self.comm.add_live_bytes,
                                 self.reducer.note_source)
        # Across graphs (compile.regions='blocks': one graph per block, so each block's first run would wait): the
        # last run of a graph starts the run that came next in the last step, while this step has followed it
        self.runs = GatherRuns(self.params, names, group=self.group, world_size=self.world_size, device=self.device,
                               shards_offloaded=shards_offloaded,
                               native_start=native is not None and self.device.type == "cuda",
                               prefetch_across_graphs=prefetch_across_graphs, comm=self.comm,
                               host=None if self.host is None else self.host.gather,
                               is_gathered=self._has_copy,
                               add_gathered=lambda param, dtype, flat, shard: self._add_gathered(param, dtype, flat,
                                                                                                 0, shard),
                               name=self.eager.name)
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
        # a submodule that returns its own parameter to a caller run as Python gets it gathered (eager_access.py)
        self._gathering_returned = install_forwards_gathering_returned(engine.module)
        self.id = registry.register(self)

    @property
    def counters(self) -> Counters:
        return self.comm.counters

    @property
    def gather_plans(self):
        return self.runs.plans

    def prefetch_bucket_bytes(self) -> int:
        """``stage3_prefetch_bucket_size`` in bytes of the widest sharded parameter dtype (0 when it is 0)."""
        itemsize = max((p.ds_tensor.element_size() for p in self.sharded.values()), default=0)
        return self.gather_bucket_numel * itemsize

    def reset_counters(self) -> None:
        self.comm.reset_counters()

    # ----- parameters ------------------------------------------------------------------------------------
    def param_ds_ids(self, inputs) -> List[Optional[int]]:
        """ds_id of every graph input that is one of this engine's ZeRO-3 parameters (None elsewhere)."""
        return [t.ds_id if isinstance(t, Parameter) and self.sharded.get(getattr(t, "ds_id", None)) is t else None
                for t in inputs]

    def param_of(self, standin: Tensor) -> Parameter:
        """The sharded parameter a graph input stands in for (the ops find their parameter this way, so a graph
        serves any module of the same code): its stand-in's storage, which the parameter's ``.data`` views while
        the graphs run (``standins.install``), whatever wrapper of it the graph was handed."""
        # the storage and the data pointer: a parameter gathered for eager code may share one storage with others
        # (ZeRO-3 gathers a leaf module's parameters into one buffer), a stand-in never does
        address = (standin.untyped_storage().data_ptr(), standin.data_ptr())
        param = self._by_standin.get(address)
        if param is None or (param.data.untyped_storage().data_ptr(), param.data.data_ptr()) != address:
            # not from an empty .data: ZeRO's own partitioned ones all share one address, which names no parameter
            self._by_standin = {(p.data.untyped_storage().data_ptr(), p.data.data_ptr()): p
                                for p in self.sharded.values() if p.data.numel()}
            param = self._by_standin.get(address)
            if param is None and standin.numel() == 0:
                # a graph saved the parameter itself for its backward, and the step's backward has put ZeRO's empty
                # .data back since: this backward runs after the one that ended its step
                raise registry.backward_after_its_step()
            if param is None:
                raise AssertionError("deepspeed-compile: a graph op was given a tensor that is not the stand-in of "
                                     "a sharded ZeRO-3 parameter of this engine")
        return param

    # ----- gather / release ------------------------------------------------------------------------------
    def gather(self, standin: Tensor, traced_ds_id: int, dtype: Optional[torch.dtype], plan: str = "") -> Tensor:
        """The ``gather_param`` op: the parameter ``standin`` stands in for, gathered (or its gathered copy shared).
        ``traced_ds_id`` is the parameter the graph was traced with: the graph may run on another module's."""
        param = self.param_of(standin)
        if self._forward_running:
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
        entry = self._gathered.get(key)
        if entry is not None:
            entry.refs += 1
            return entry.tensor
        if held:
            return self._copy_held(param, key)
        self.comm.before_start()
        start = time.perf_counter()
        gathered_from = shard_state(param)
        if self.runs.shards_offloaded:
            shard = shard.to(self.device, non_blocking=True)
            self.counters.shard_copies += 1
        self.comm.issued("all-gather", (param,), shard.numel())
        # the shard is cast before it is sent: bf16 moves half the bytes of gathering fp32 and casting after
        with self.comm.timeout_named(lambda: f"the all-gather of parameter {self.eager.name(param)}"):
            if self.host is not None:
                flat = self._host_gather(param, shard, dtype)
            else:
                flat = self._cast_all_gather(shard, dtype, self.group, self.world_size, self.comm.timeout)
        self.comm.done("all-gather", start)
        self.counters.allgather_collectives += 1
        self.counters.count_gather_path("shm" if self.host is not None else self.gather_op)
        return self._add_gathered(param, dtype, flat, 1, gathered_from)

    def _host_gather(self, param: Parameter, shard: Tensor, dtype: torch.dtype) -> Tensor:
        """One parameter gathered through shared memory: cast into this rank's slot, every rank's slot copied out."""
        (flat, ), work = start_gather(self.host.gather, [shard.reshape(-1)], dtype, ident=param.ds_id)
        wait_for(work, self.comm.timeout)
        return flat

    def _copy_held(self, param: Parameter, key: Tuple[int, torch.dtype]) -> Tensor:
        """A copy of a parameter eager code holds gathered, in the gather's dtype, freed by its release as a gathered
        copy is. Not the data itself: an op's output may not alias its input, and the parameter is that input."""
        full = param.data.to(key[1], copy=True)
        nbytes = full.numel() * full.element_size()
        self._gathered[key] = _Gathered(full, 1, nbytes, shard_state(param))
        self._gathered_at[full.data_ptr()] = key
        self._forgotten_at.discard(full.data_ptr())
        self.comm.add_live_bytes(nbytes, eager=False)
        return full

    def _has_copy(self, key: Tuple[int, torch.dtype]) -> bool:
        """A run need not gather this (ds_id, dtype): a gathered copy exists, or eager code holds it gathered."""
        return key in self._gathered or self.eager.holds(self.params[key[0]])

    def _add_gathered(self, param: Parameter, dtype: torch.dtype, flat: Tensor, refs: int,
                      shard: Tuple[int, int]) -> Tensor:
        full = flat.narrow(0, 0, param.ds_numel).view(param.ds_shape)
        nbytes = flat.numel() * flat.element_size()
        self._gathered[(param.ds_id, dtype)] = _Gathered(full, refs, nbytes, shard)
        self._gathered_at[full.data_ptr()] = (param.ds_id, dtype)
        self._forgotten_at.discard(full.data_ptr())  # the address of a forgotten copy, freed since and reused
        c = self.counters
        c.gathers += 1
        c.allgather_bytes += nbytes
        c.allgather_bytes_by_dtype[str(dtype)] = c.allgather_bytes_by_dtype.get(str(dtype), 0) + nbytes
        self.comm.add_live_bytes(nbytes, eager=False)
        return full

    def _drop_unclaimed(self) -> None:
        """Free prefetched parameters whose gather never ran (none should be left: a safety net)."""
        self.runs.finish_inflight()
        for key in [k for k, e in self._gathered.items() if e.refs == 0]:
            self._forget(key)

    def _forget(self, key: Tuple[int, torch.dtype]) -> int:
        """The runtime lets go of a gathered copy and returns its bytes: an unclaimed one is freed; one a graph still
        references (kept for a backward) is left to that graph, whose release of it is then a no-op."""
        entry = self._gathered.pop(key)
        address = entry.tensor.data_ptr()
        self._gathered_at.pop(address, None)
        if entry.refs == 0:
            self.counters.unclaimed_gathers += 1
            if self.free_on_release:
                entry.tensor.untyped_storage().resize_(0)
        else:
            self._forgotten_at.add(address)
        self.comm.add_live_bytes(-entry.nbytes, eager=False)
        return entry.nbytes

    def _forget_stale(self) -> None:
        """Before each forward: gathered copies that no longer hold their parameter's weights must not be shared by the
        next gather (:meth:`_forget_held`), nor a run prefetched before they changed be taken. After an optimizer step
        that is every copy. Between steps, a forward whose backward has not run (an evaluation that forgot
        ``no_grad``) keeps copies for that backward, and user code may have written a parameter since
        (``GatheredParameters`` with a ``modifier_rank``, ``load_state_dict`` inside it): the copies of the
        parameters whose shard changed are forgotten."""
        if self.engine.global_steps != self._gathered_step:
            self._gathered_step = self.engine.global_steps
            self._drop_unclaimed()
            self._forget_held()
            return
        if not self._gathered and not self.runs.has_inflight:
            return  # the common case: the last backward left nothing
        self.runs.finish_inflight()  # into the unclaimed copies, each with the shard it was gathered from
        for key in [k for k, e in self._gathered.items() if e.shard != shard_state(self.params[k[0]])]:
            self._forget(key)

    def _forget_held(self) -> int:
        """Forget the gathered copies still referenced. At the end of a backward, and at an
        optimizer step, a copy is referenced only by a forward whose backward never ran (an evaluation that forgot
        ``no_grad``, an output dropped): the parameters its graph keeps for backward are never released. Shared by a
        later gather they would hold the runtime's memory for good and, after an optimizer step, the old weights (a
        later forward trained on them). Forgotten, they are gathered anew when used; their storage goes with the
        autograd graph that saved them (not freed here: a backward of that graph still reads them, and its releases
        are then no-ops).

        Returns the bytes of those copies that stay allocated once the runtime lets go: held by an autograd graph
        still alive (its output kept) whose backward has not run. A graph whose output was dropped (``.item()`` of an
        evaluation's loss, a result used detached, as peft's DoRA uses its weight norm) is gone already, and so are
        its copies once forgotten."""
        keys = [key for key, entry in self._gathered.items() if entry.refs > 0]
        storages: Dict[int, Tuple[StorageWeakRef, int]] = {}  # a run's members share one flat storage
        for key in keys:
            storage = self._gathered[key].tensor.untyped_storage()
            storages.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
            del storage  # no reference of ours may outlive the forgetting below
        for key in keys:
            self._forget(key)
        return sum(nbytes for ref, nbytes in storages.values() if not ref.expired())

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
            self.comm.add_live_bytes(-entry.nbytes, eager=False)

    # ----- gradient reduction ----------------------------------------------------------------------------
    def reduce_op(self, grad: Tensor, ds_id: int, standin: Optional[Tensor]) -> None:
        """The ``reduce_grad`` op: the gradient of the parameter ``standin`` stands in for. Without one, of parameter
        ``ds_id``: a graph that hands a parameter back as it is gets its gradient as a backward input, with no
        stand-in to name it (such graphs are bound to their traced parameters, ``compiler.make_backend``)."""
        param = self.params[ds_id] if standin is None else self.param_of(standin)
        if not gradient_wanted(param):  # torch.autograd.grad of other inputs: this gradient is dropped, as autograd's
            return
        # a ZeRO-3 leaf module's parameter is held to the end of backward (EagerAccess.reduce_leaf_grads)
        if not self.eager.hold_leaf_grad(param, grad):
            self.reducer.reduce(param.ds_id, grad)

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
        uninstall_forwards_gathering_returned(self._gathering_returned)
        self._gathering_returned = []
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
            self.runs.end_of_step(learn=False)
            self._drop_unclaimed()
            self.reducer.forget_sources()
            self.eager.release()
            standins.uninstall(self.params.values())

    def backward_prologue(self, is_boundary: bool) -> None:
        return None  # accumulation is the optimizer's (micro_step_id); nothing to prepare per backward

    def backward_epilogue(self) -> None:
        if not self._backward_pending:
            return
        self.eager.reduce_leaf_grads(self.reducer.bucket_grad)
        self.reducer.end_of_backward()
        self.runs.end_of_step(learn=True)
        self._drop_unclaimed()
        # DeepSpeed's epilogue points averaged_gradients at the partitions we filled and ends the micro-step
        self.optimizer.independent_gradient_partition_epilogue()
        self.eager.release()
        standins.uninstall(self.params.values())
        self._backward_pending = False
        retained = self._forget_held()
        if retained and not self._warned_forgotten:
            self._warned_forgotten = True
            log.warning("deepspeed-compile: a forward ran with grad enabled, its output is still referenced and its "
                        "backward has not run (an evaluation without torch.no_grad() whose loss is kept?): the %d "
                        "gathered bytes its graph keeps for backward stay allocated until that output is freed (eager "
                        "ZeRO-3 frees its parameters after each module instead). Run such forwards under "
                        "torch.no_grad()", retained)
        if self.counters.live_gathered_bytes:
            log.warning("deepspeed-compile: %d gathered bytes still live after backward",
                        self.counters.live_gathered_bytes)

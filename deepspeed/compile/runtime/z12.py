# SPDX-License-Identifier: Apache-2.0
"""The per-engine runtime of DeepCompile for ZeRO stages 1 and 2: gradients handed to ZeRO from the compiled backward.

Parameters are replicated in these stages, so the graphs gather nothing. What DeepCompile changes is where each
gradient goes: the backward graph hands each gradient to ZeRO's optimizer as soon as it exists, exactly as autograd
would have (``z12_handoff.py``). DeepSpeed's optimizer then does what it does in eager
ZeRO-1/2, with every option it has: ZeRO-2 copies the gradient into its reduce bucket and reduces full buckets
while backward goes on, dropping the full-size gradient; ZeRO-1 keeps it until the accumulation boundary. One
thing is changed: eager ZeRO-2 waits for each full bucket's collective inside backward (on CPU always, elsewhere
without ``overlap_comm``), and here it is left in flight until the next full bucket or the end of backward
(``z12_reduce.py``). At the end of backward the runtime runs the reduction the engine skips while DeepCompile is
active (``engine.allreduce_gradients``). Same buckets, same collectives, same casts: the arithmetic is eager
ZeRO-1/2's, bit for bit.

One :class:`Z12Runtime` per compiled engine coordinates its parts: ``table`` (:class:`~.z12_handoff.TrainedParams`,
the trained parameters by ds_id), ``handoff`` (:class:`~.z12_handoff.GradientHandOff`, the gradients' way to ZeRO),
``flush`` (:class:`~.z12_reduce.BucketFlush`, ZeRO-2's bucket reductions left in flight) and, as every stage
(``stage.py``), the transport, the comm log, the peers and the step's phase.
"""
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor
from torch.nn import Parameter

from .. import compat
from ..adapters import ZeroBucketReduction
from .host_comm import DEFAULT_DIR, REDUCE_SLOT_BYTES
from .ops import gradient_wanted
from .stage import Phase, StageRuntime
from .transport import Transport
from .z12_handoff import GradientHandOff, TrainedParams
from .z12_reduce import BucketFlush


def _open_transport(engine, mode: str, directory: str) -> Transport:
    """The bucket all-reduces the flush starts itself (ZeRO-2's) go through shared memory where every rank is on this
    host (``compile.host_comm``); ZeRO's own paths (ZeRO-1's among them) go through the process group."""
    optimizer = engine.optimizer
    group, device = optimizer.dp_process_group, torch.device(engine.device)
    if not BucketFlush.can_overlap(optimizer):
        return Transport(group, device, None, "ZeRO's own reductions (not overlapped) go through the process group")
    numel = sum(p.numel() for group in optimizer.bit16_groups for p in group)
    return Transport.open(mode, group, device, gather_slot_bytes=0,
                          reduce_slot_bytes=min(REDUCE_SLOT_BYTES, numel * 4), directory=directory)


class Z12Runtime(StageRuntime):
    # a frame run as Python past dynamo's recompile limit hands its gradients to ZeRO through the runtime as a graph
    # does, in the same buckets: the ranks' collectives stay the same, nothing to agree on
    agrees_at_recompile_limit = False

    def __init__(self, engine, *, stage: int, timeout_s: float = 0.0, host_comm: str = "auto",
                 host_comm_dir: str = DEFAULT_DIR):
        compat.require_attributes(engine.optimizer, compat.ZERO12_OPTIMIZER_STATE, "DeepSpeedZeroOptimizer")
        self.stage = stage
        super().__init__(engine, _open_transport(engine, host_comm, host_comm_dir), timeout_s)
        self.table = TrainedParams(self.optimizer, engine.module)
        self.handoff = GradientHandOff(self.optimizer, self.table, stage, self.comm, self.peers,
                                       lambda: self.phase is not Phase.IDLE)
        self.handoff.take_over_grad_hooks()
        # ZeRO's bucket reductions, counted, and at ZeRO-2 left in flight while backward goes on
        self.flush = BucketFlush(self.optimizer, self.comm,
                                 None if self.transport.host is None else self.transport.host.reduce)
        ZeroBucketReduction.install(self.optimizer, self.flush.reduce_ipg_grads, self.flush.setup_buckets)

    # ----- what the compiler asks -------------------------------------------------------------------------
    @property
    def params(self) -> Dict[int, Parameter]:
        return self.table.params

    def grad_ds_ids(self, inputs) -> List[Optional[int]]:
        """For every graph input, the ds_id of the trained parameter it is (its gradient is reduced in the graph)."""
        return [self.table.get(t) if isinstance(t, Parameter) else None for t in inputs]

    def note_graph_call(self, args: Sequence, grad_inputs: Sequence[int]) -> None:
        """A compiled forward graph ran with grad enabled: each trained parameter among its inputs owes one more
        gradient in the coming backward, and so does each one eager code used to compute its inputs."""
        if not torch.is_grad_enabled():
            return
        for i in grad_inputs:
            self.handoff.note_source(args[i])
        self.handoff.note_eager_uses(args)

    # ----- gradients ------------------------------------------------------------------------------------
    def reduce_op(self, grad: Tensor, traced_ds_id: int, param: Optional[Tensor], owned: bool = False) -> None:
        """The ``reduce_grad`` op: the gradient of ``param``, the parameter the backward was handed (the graph may
        serve another module of the code it was traced on, whose parameter ``traced_ds_id`` names). ``owned`` makes
        no difference here: ZeRO's own buckets take the gradient."""
        ds_id = self.table.ds_id_of(param)
        if gradient_wanted(self.params[ds_id]):  # else torch.autograd.grad of other inputs: dropped, as autograd does
            self.handoff.reduce(ds_id, grad)

    def reduce_product_op(self, mat1: Tensor, mat2: Tensor, traced_ds_id: int, param: Optional[Tensor]) -> None:
        """The ``reduce_grad_mm`` op: ``param``'s gradient is ``mat1 @ mat2`` (``GradientHandOff.reduce_product``);
        not computed where autograd does not want it."""
        ds_id = self.table.ds_id_of(param)
        if gradient_wanted(self.params[ds_id]):
            self.handoff.reduce_product(ds_id, mat1, mat2)

    # ----- engine hooks ----------------------------------------------------------------------------------
    def detach(self) -> None:
        """Give ZeRO its own gradient hooks and reductions back (the engine returns to eager ZeRO-1/2)."""
        self.flush.finish()
        self.handoff.give_back_grad_hooks()
        ZeroBucketReduction.remove(self.optimizer)
        super().detach()

    @contextmanager
    def forward_context(self):
        """One forward of the engine; with grad enabled, a backward will end the step's gradient bookkeeping."""
        if not self.backward_owed:
            self.handoff.forget_sources()
        try:
            with self._forward_phase():
                yield
        finally:
            self.handoff.end_of_forward()
        if self.phase is Phase.IDLE:
            self.handoff.forget_sources()

    def backward_epilogue(self) -> None:
        if not self.backward_owed:
            return
        self.phase = Phase.IDLE
        self.handoff.end_of_backward()
        self._reduce_as_the_engine()
        self.flush.finish()  # where the engine reduced nothing at the end, what started in backward still lands

    def _reduce_as_the_engine(self) -> None:
        """``engine.allreduce_gradients`` (which the engine skips while DeepCompile is active), for ZeRO-1/2."""
        engine, optimizer = self.engine, self.optimizer
        if not engine.enable_backward_allreduce or engine.inside_no_sync_ctxt:
            return
        self.peers.before_collective()
        boundary = engine.is_gradient_accumulation_boundary()
        optimizer.set_gradient_accumulation_boundary(boundary)
        if engine.zero_optimization_partition_gradients():
            optimizer.overlapping_partition_gradients_reduce_epilogue()
        elif boundary:
            optimizer.reduce_gradients(pipeline_parallel=engine.pipeline_parallelism)

    def report_items(self) -> dict:
        """ZeRO-1/2's own entries of ``engine_report`` (report.py adds what every stage reports)."""
        c = self.counters.reduce
        return {
            "eager_grads": c.eager_grads,
            "reduces_started_ahead": c.reduces_started_ahead,  # ZeRO-2 bucket reductions left in flight
            "matmul_grads": c.matmul_grads,  # weight gradients the reduce computed (fused with their matmul)
            "grads_in_bucket": c.grads_in_bucket,  # of those, computed in ZeRO-2's bucket: no copy into it
        }

# SPDX-License-Identifier: Apache-2.0
"""The one protocol every stage's runtime keeps: what the engine and the compiler ask of ZeRO-3's
(:class:`~.z3.Z3Runtime`) and ZeRO-1/2's (:class:`~.z12.Z12Runtime`) alike.

[Note: one id vocabulary] A graph op names a parameter by an integer, its ``ds_id``: ZeRO-3's own ``param.ds_id``,
or at ZeRO-1/2, where parameters carry none, the runtime's index of each trained parameter in the optimizer's order.
``runtime.params`` maps it back to the parameter at every stage.

[Note: step phases] A runtime is in one :class:`Phase` at a time. A forward of the engine moves it to ``FORWARD``
and, with grad enabled, leaves it ``BACKWARD_OWED``: the ``engine.backward()`` that follows ends the step's
gradient bookkeeping (``backward_epilogue``) and returns it to ``IDLE``. A second forward before that backward
(gradient accumulation within one loss, an evaluation that forgot ``no_grad``) runs in ``FORWARD`` and leaves it
``BACKWARD_OWED`` again: one backward covers every forward since the last.
"""
import enum
from contextlib import contextmanager
from typing import List, Optional

import torch

from ..adapters import TensorParallelDeferral
from . import registry
from .agreement import Peers
from .comm import CommLog, Counters
from .host_memory import HostHeap
from .transport import Transport


class Phase(enum.Enum):
    IDLE = "idle"  # no forward running and no backward owed
    FORWARD = "forward"  # a forward runs (ZeRO-3: also a submodule called outside any forward)
    BACKWARD_OWED = "backward owed"  # a forward ran with grad enabled; the engine's backward has not ended the step


class StageRuntime:
    """The parts every stage has: ``transport`` (where collectives go), ``comm`` (counters, waits, recordings),
    ``peers`` (the ranks' agreement), the step's :class:`Phase`, the engine's fp16 input cast while DeepCompile
    replaces its hook, and the ``id`` the graph ops carry. A subclass owns its stage's parts and implements the rest
    of the protocol: ``params``, ``param_ds_ids``, ``grad_ds_ids``, ``reduce_op``, ``forward_context``,
    ``backward_epilogue``, ``detach`` and ``report_items``."""
    stage: int
    gather_bucket_numel = 0  # the most elements a coalesced run of gathers holds (0: nothing gathered or coalesced)

    def __init__(self, engine, transport: Transport, timeout_s: float):
        self.engine = engine
        self.optimizer = engine.optimizer
        self.transport = transport
        self.comm = CommLog(timeout_s)
        self.peers = Peers(transport.group, transport.host, self.comm.timeout)
        self.comm.before_start = self.peers.before_collective  # every collective agrees first where one is due
        self.phase = Phase.IDLE
        self.input_cast_hook = None  # fp16 auto_cast: the engine's input cast, as a forward pre-hook (engine_state)
        self.sequence = None  # the sequence group where "passes" lists "autosp" (runtime/sequence.py), else None
        self.tensor = None  # AutoTP's group where "passes" lists "autotp" (runtime/tensor.py), else None
        self.tensor_layers: List = []  # the AutoTP layers whose collectives the graphs place (adapters)
        self.host_heap = HostHeap()  # compile.release_host_memory: set by the engine's state, off until then
        self.id = registry.register(self)

    # ----- what the engine and the report read ------------------------------------------------------------
    @property
    def counters(self) -> Counters:
        return self.comm.counters

    def reset_counters(self) -> None:
        self.comm.reset_counters()
        self.host_heap.reset_counters()

    @property
    def forward_running(self) -> bool:
        return self.phase is Phase.FORWARD

    @property
    def backward_owed(self) -> bool:
        return self.phase is Phase.BACKWARD_OWED

    @property
    def host_comm(self) -> str:
        return self.transport.kind

    def close(self) -> None:
        self.transport.close()

    # ----- what the compiler asks ---------------------------------------------------------------------------
    def param_ds_ids(self, inputs) -> List[Optional[int]]:
        """ds_id of every graph input the graphs gather (none outside ZeRO-3)."""
        return [None] * len(inputs)

    def note_graph_call(self, args, grad_inputs) -> None:
        """A compiled forward graph ran (ZeRO-1/2 count the gradients its backward owes)."""
        return None

    def prefetch_bucket_bytes(self) -> int:
        return 0

    # ----- the step -----------------------------------------------------------------------------------------
    @contextmanager
    def _forward_phase(self):
        """The phase around one forward (see the module's note); yields whether a backward was owed before it."""
        owed = self.phase is Phase.BACKWARD_OWED
        self.phase = Phase.FORWARD
        try:
            yield owed
        except BaseException:
            self.phase = Phase.BACKWARD_OWED if owed else Phase.IDLE
            raise
        self.phase = Phase.BACKWARD_OWED if owed or torch.is_grad_enabled() else Phase.IDLE

    def backward_prologue(self, is_boundary: bool) -> None:
        return None  # accumulation is the optimizer's (micro_step_id); nothing to prepare per backward

    def end_backward(self) -> None:
        """The engine's backward ended: the stage's ``backward_epilogue``; then, where it ended the step's gradient
        bookkeeping at an accumulation boundary, the host memory the step freed goes back to the OS before the
        optimizer step (``host_memory.py``)."""
        ended = self.backward_owed
        self.backward_epilogue()
        if ended and self.engine.is_gradient_accumulation_boundary():
            self.host_heap.release()

    def detach(self) -> None:
        """The engine returns to eager ZeRO: what every stage put on the engine comes off (a subclass adds its
        own)."""
        if self.input_cast_hook is not None:
            self.input_cast_hook.remove()
            self.input_cast_hook = None
        TensorParallelDeferral.restore(self.tensor_layers)  # the layers' own collectives back
        self.tensor_layers = []

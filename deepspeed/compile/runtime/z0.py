# SPDX-License-Identifier: Apache-2.0
"""ZeRO-0's runtime: no state is sharded, so the graphs gather and reduce nothing and the engine all-reduces the
gradients itself after backward, as without DeepCompile. It exists for the sequence group (``"passes":
["autosp"]``, ``runtime/sequence.py``), whose collectives the graphs place, and for the protocol every stage keeps
(``runtime/stage.py``): its phases, counters and report."""
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch
from torch import Tensor
from torch.nn import Parameter

from .stage import Phase, StageRuntime
from .transport import Transport


class Z0Runtime(StageRuntime):
    stage = 0

    def __init__(self, engine, *, timeout_s: float = 0.0):
        group = engine.seq_data_parallel_group  # every rank (engine_state.activate_z0): the engine's average
        super().__init__(engine, Transport(group, torch.device(engine.device), None,
                                           "ZeRO-0: the engine all-reduces the gradients through the process group"),
                         timeout_s)

    @property
    def params(self) -> Dict[int, Parameter]:
        return {}  # no graph op names a parameter

    def grad_ds_ids(self, inputs) -> List[Optional[int]]:
        return [None] * len(inputs)  # gradients stay autograd's, for the engine's all-reduce

    def reduce_op(self, grad: Tensor, traced_ds_id: int, param: Optional[Tensor], owned: bool = False) -> None:
        raise RuntimeError("deepspeed-compile: a ZeRO-0 graph reduced a gradient; the engine reduces them itself")

    @contextmanager
    def forward_context(self):
        """One forward. The engine's backward owes this runtime nothing (it reduces the gradients itself)."""
        with self._forward_phase():
            yield
        self.phase = Phase.IDLE

    def backward_epilogue(self) -> None:
        return None

    def report_items(self) -> dict:
        return {}

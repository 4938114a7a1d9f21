# SPDX-License-Identifier: Apache-2.0
"""Rank-side helpers: build a DeepSpeed engine on one of the test models and train it."""
import logging
from typing import Any, Callable, Dict, List, Optional

import deepspeed
import torch

from models import make_batch, make_model


class RecordWarnings(logging.Handler):
    """Collects the warnings DeepSpeed's logger emits (it does not propagate to the root logger)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: List[str] = []
        deepspeed.utils.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def make_engine(model_name: str, config: Dict[str, Any], seed: int = 0):
    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model(model_name, seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                      config=config)
    return engine


def train(engine, model_name: str, steps: int, compile_kwargs: Optional[Dict[str, Any]] = None,
          after_step: Optional[Callable[[Any], None]] = None, first_step: int = 0,
          after_backward: Optional[Callable[[Any, int], None]] = None) -> List[float]:
    """Train ``steps`` optimizer steps (each of ``gradient_accumulation_steps`` micro-steps); returns the loss of
    every micro-step. ``after_backward(engine, step)`` runs between each backward and ``engine.step()``."""
    if compile_kwargs is not None:
        engine.compile(**compile_kwargs)
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(first_step, first_step + steps):
        for micro in range(engine.gradient_accumulation_steps()):
            batch = make_batch(model_name, step * 100 + micro, rank)
            loss = engine(*batch)
            engine.backward(loss)
            if after_backward is not None:
                after_backward(engine, step)
            engine.step()
            losses.append(loss.item())
        if after_step is not None:
            after_step(engine)
    return losses

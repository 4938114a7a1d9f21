# SPDX-License-Identifier: Apache-2.0
"""Dynamo's recompile limit, seen by the engine before the frame runs uncompiled.

Past ``torch._dynamo.config.recompile_limit`` dynamo logs a warning and runs the frame as Python, on that rank only.
Ranks fed different input shapes reach it at different steps, and a rank that runs a frame uncompiled while its peers
run the frame's graph issues other collectives. :func:`install` wraps dynamo's check (``exceeds_recompile_limit``, as
``convert_frame`` calls it) once per process, so that a limit reached calls ``on_limit`` first, with the limit's
name and value, on the thread about to run the frame. The engine makes the ranks agree there (``engine_state``).
"""
from typing import Callable

import torch
from torch._dynamo import convert_frame

_MARK = "_deepspeed_compile_on_limit"


def install(on_limit: Callable[[str], None]) -> None:
    """Call ``on_limit(cause)`` whenever dynamo finds a frame past its recompile limit; idempotent."""
    original = convert_frame.exceeds_recompile_limit
    if getattr(original, _MARK, None) is on_limit:
        return
    original = getattr(original, "__wrapped__", original)

    def exceeds_recompile_limit(*args, **kwargs):
        exceeded, limit_type = original(*args, **kwargs)
        if exceeded:
            on_limit(f"torch._dynamo.config.{limit_type} ({getattr(torch._dynamo.config, limit_type)}) at a frame "
                     "of the model (a new input shape): dynamo runs that frame uncompiled on this rank")
        return exceeded, limit_type

    exceeds_recompile_limit.__wrapped__ = original
    setattr(exceeds_recompile_limit, _MARK, on_limit)
    convert_frame.exceeds_recompile_limit = exceeds_recompile_limit

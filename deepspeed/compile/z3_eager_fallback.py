# SPDX-License-Identifier: Apache-2.0
"""Entry point (stock ``engine.py`` and ZeRO-3's ``parameter_offload.py`` import it by name).

DeepSpeed's engine wraps every forward in :func:`deepcompile_z3_forward_context` (``engine_state.forward_context``).
During that forward :func:`get_active_z3_eager_fallback` returns the runtime's
:class:`~deepspeed.compile.runtime.eager_access.EagerAccess`: ZeRO-3's parameter dicts then gather any parameter
that code outside the compiled graphs reads, and report it there for release after backward.
"""
import sys

from .engine_state import forward_context
from .runtime import eager_access


def deepcompile_z3_forward_context(engine):
    return forward_context(engine)


def get_active_z3_eager_fallback():
    return eager_access.active()


def is_dynamo_guard_evaluation() -> bool:
    """True while dynamo evaluates guards (it reads parameters then, and must not trigger a gather)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("torch._dynamo.guards"):
            return True
        frame = frame.f_back
    return False

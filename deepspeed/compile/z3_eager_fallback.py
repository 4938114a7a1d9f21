"""Engine-facing forward context (``deepspeed.compile.z3_eager_fallback``).

DeepSpeed's engine wraps every forward in :func:`deepcompile_z3_forward_context`; this module uses it to
prepare the engine's runtime for a compiled forward (full-shape parameter stand-ins, see
``docs/capture.md``). During that forward :func:`get_active_z3_eager_fallback` returns the runtime's
:class:`~deepspeed.compile.runtime.eager_access.EagerAccess`: ZeRO-3's parameter dicts then gather any parameter
that code outside the compiled graphs reads, and report it there for release after backward.
"""
import sys
from contextlib import contextmanager

from .runtime import eager_access

RUNTIME_ATTR = "_deepspeed_compile_runtime"


@contextmanager
def deepcompile_z3_forward_context(engine):
    runtime = getattr(engine, RUNTIME_ATTR, None)
    if runtime is None:
        yield None
        return
    if not engine.is_deepcompile_active():
        # the engine left DeepCompile (failure, or deactivated): run this forward as eager ZeRO-3
        from .init_z3 import deactivate
        deactivate(engine)
        yield None
        return
    with runtime.forward_context():
        yield None


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

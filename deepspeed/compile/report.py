"""What a compiled ZeRO-3 engine did, for users, tests and the benchmark.

    from deepspeed.compile.report import engine_report
    engine_report(engine)   # None unless the engine runs deepspeed-compile's ZeRO-3 pipeline

Saved-for-backward bytes are summed over the engine's compiled forward graphs (computed from the partitioned
graphs' tensor metadata); communication and gathered-memory figures are cumulative since compile or the last
:func:`reset_counters`.
"""
from typing import Any, Dict, List, Optional, Tuple

from .z3_eager_fallback import RUNTIME_ATTR


def _runtime(engine):
    runtime = getattr(engine, RUNTIME_ATTR, None)
    return runtime if runtime is not None and engine.is_deepcompile_active() else None


def engine_report(engine) -> Optional[Dict[str, Any]]:
    runtime = _runtime(engine)
    if runtime is None:
        return None
    c, s = runtime.counters, runtime.saved
    return {
        "graphs_compiled": runtime.graphs_compiled,
        "gather_path": runtime.gather_path,
        "gather_seconds": c.gather_seconds,
        "saved_param_bytes": s.param_bytes,
        "saved_other_bytes": s.other_bytes,
        "saved_param_tensors": s.param_tensors,
        "saved_other_tensors": s.other_tensors,
        "allgather_bytes": c.allgather_bytes,
        "allgather_bytes_by_dtype": dict(c.allgather_bytes_by_dtype),
        "reduce_scatter_bytes": c.reduce_scatter_bytes,
        "gathers": c.gathers,
        "allgather_collectives": c.allgather_collectives,
        "eager_gathers": c.eager_gathers,
        "reduces": c.reduces,
        "reduce_collectives": c.reduce_collectives,
        "reduce_wait_seconds": c.reduce_wait_seconds,
        "live_gathered_bytes": c.live_gathered_bytes,
        "peak_gathered_bytes": c.peak_gathered_bytes,
    }


def record_gathered_timeline(engine, on: bool = True) -> None:
    """Start (clearing what was recorded) or stop recording live gathered bytes at every gather and release."""
    runtime = _runtime(engine)
    if runtime is not None:
        runtime.gathered_timeline = [] if on else None


def gathered_timeline(engine) -> Optional[List[Tuple[float, int]]]:
    """``(time.perf_counter(), live gathered bytes)`` at every change since recording started."""
    runtime = _runtime(engine)
    return None if runtime is None or runtime.gathered_timeline is None else list(runtime.gathered_timeline)


def reset_counters(engine) -> None:
    """Zero the cumulative counters (not the saved-for-backward report, a property of the compiled graphs)."""
    runtime = _runtime(engine)
    if runtime is not None:
        runtime.reset_counters()

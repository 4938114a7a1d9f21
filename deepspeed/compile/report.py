# SPDX-License-Identifier: Apache-2.0
"""What a compiled engine did, for users, tests and the benchmark.

    from deepspeed.compile.report import engine_report
    engine_report(engine)   # None unless the engine runs deepspeed-compile's pipeline (ZeRO-1, 2 or 3)

Saved-for-backward bytes are summed over the engine's compiled forward graphs (computed from the partitioned
graphs' tensor metadata); communication and gathered-memory figures are cumulative since compile or the last
:func:`reset_counters`.
"""
from typing import Any, Dict, List, Optional, Tuple

from .engine_state import runtime_of, state_of


def engine_report(engine) -> Optional[Dict[str, Any]]:
    """What the engine's DeepCompile did; None unless it runs DeepCompile now. Every stage reports its compiled graphs
    and gradient reductions; ZeRO-3 adds its gathers and gathered memory."""
    state = state_of(engine)
    if state is None:
        return None
    runtime = state.runtime
    c, s = runtime.counters.reduce, state.stats.saved
    report = {
        "zero_stage": state.stage,
        "graphs_compiled": state.stats.graphs_compiled,
        # of those, loaded from torch's AOTAutograd cache (inductor): our compilers did not run for them, so
        # compile_seconds and pass_seconds leave them out; the saved bytes and planned peak come from their records
        "graphs_loaded": state.stats.graphs_loaded,
        "graphs_by_backend": dict(state.stats.graphs_by_backend),
        "saved_param_bytes": s.param_bytes,
        "saved_other_bytes": s.other_bytes,
        "saved_param_tensors": s.param_tensors,
        "saved_other_tensors": s.other_tensors,
        "reduces": c.reduces,
        "reduce_bytes": c.reduce_bytes,
        "reduce_collectives": c.reduce_collectives,
        "reduce_wait_seconds": c.reduce_wait_seconds,
        "pass_seconds": dict(state.stats.pass_times),
        "compile_seconds": dict(state.stats.compile_seconds),
        # "shm": the collectives through shared memory between the ranks of this host (compile.host_comm)
        "host_comm": runtime.transport.kind,
        "host_comm_bytes": 0 if runtime.transport.host is None else runtime.transport.host.bytes,  # this rank's
        "host_comm_reason": runtime.transport.reason,  # why not shared memory (None where it is)
        # the memory plan of the gathers and the parameters kept gathered for backward (compile.keep_gathered_bytes),
        # summed over the graphs (one block's with regions="blocks"): 0 where nothing is gathered (ZeRO-1/2)
        "planned_peak_gathered_bytes": state.stats.planned_peak_gathered_bytes,
        "kept_gathered_bytes": state.stats.kept_gathered_bytes,
        # "passes": ["autosp"]: the ranks splitting each sequence (1: none), and the collectives of that group placed
        # in the forward graphs (all-to-alls around attention, the loss's sum, outputs gathered)
        "sequence_parallel_size": 1 if runtime.sequence is None else runtime.sequence.size,
        "sequence_collectives": state.stats.sequence_collectives,
        # the ops of those graphs run on the whole sequence on every rank of the group (their blocks gathered first:
        # exact, not split), by op: an op no rule splits (a softmax over the sequence, a cumsum, attention whose
        # inputs are not [batch, heads, seq, dim]), with one warning naming them
        "sequence_whole_ops": dict(state.stats.sequence_whole_ops),
        # "passes": ["autotp"]: AutoTP's group size (1: none), and its layers whose collectives the graphs place
        "tensor_parallel_size": 1 if runtime.tensor is None else runtime.tensor.size,
        "tensor_parallel_layers": state.stats.tensor_parallel_layers,
        # of the backward graphs' sums over that group, those in flight while other code runs (graph/tensor.py)
        "tensor_sums_overlapped": state.stats.tensor_sums_overlapped,
        # attentions whose constant causal mask the graphs replaced by is_causal=True (graph/masks.py)
        "causal_masks": state.stats.causal_masks,
        "run_time_masks": state.stats.run_time_masks,
        # eager backend: sums the graphs write into an operand that dies there instead of a new tensor (a tied
        # weight's two gradients, gradients of a residual stream; graph/in_place.py)
        "sums_in_place": state.stats.sums_in_place,
        # compile.release_host_memory: whether it is on, how often the allocator's free memory was handed back to the
        # OS before an optimizer step, the resident bytes that took off (summed) and the seconds it cost
        "host_memory_release": runtime.host_heap.enabled,
        **runtime.host_heap.report_items(),
    }
    report.update(runtime.report_items())  # what the stage's parts did (ZeRO-3's gathers, ZeRO-1/2's hand-offs)
    return report


def collective_orders(engine) -> Optional[List[List[Tuple[str, int]]]]:
    """Per compiled graph, in compile order: its gathers and reduces as ``(op, ds_id)``. Every rank must issue the
    same sequence; a test or a user comparing ranks reads it here."""
    state = state_of(engine)
    return None if state is None else [list(order) for order in state.stats.collective_orders]


def record_gathered_timeline(engine, on: bool = True) -> None:
    """Start (clearing what was recorded) or stop recording live gathered bytes at every gather and release, the
    span of every collective (:func:`collective_spans`) and the collectives issued (:func:`issued_collectives`)."""
    comm = _comm_of(engine)
    if comm is not None:
        comm.record(on)


def _comm_of(engine):
    """The runtime's record of its collectives (ZeRO-1/2: the bucket reductions it starts, nothing gathered)."""
    runtime = runtime_of(engine)
    return getattr(runtime, "comm", None)


def gathered_timeline(engine) -> Optional[List[Tuple[float, int]]]:
    """``(time.perf_counter(), live gathered bytes)`` at every change since recording started."""
    comm = _comm_of(engine)
    return None if comm is None or comm.gathered_timeline is None else list(comm.gathered_timeline)


def reset_counters(engine) -> None:
    """Zero the cumulative counters (not the saved-for-backward report, a property of the compiled graphs)."""
    runtime = runtime_of(engine)
    if runtime is not None:
        runtime.reset_counters()


def collective_spans(engine) -> Optional[List[Tuple[str, float, float]]]:
    """``(kind, issued, waited for)`` in ``time.perf_counter()`` seconds for every all-gather and reduce-scatter since
    recording started: when communication was in flight. A blocking collective is issued when its wait starts."""
    comm = _comm_of(engine)
    return None if comm is None or comm.collective_spans is None else list(comm.collective_spans)


def issued_collectives(engine) -> Optional[List[Tuple[str, Tuple[int, ...], int]]]:
    """``(kind, ds_ids, elements sent)`` of every all-gather and reduce-scatter the ZeRO-3 runtime issued since
    recording started, in issue order: the runtime's own order, prefetched runs and bucket flushes included (the
    compiled graphs' static order is :func:`collective_orders`). Every rank must record the same list."""
    comm = _comm_of(engine)
    return None if comm is None or comm.issued_collectives is None else list(comm.issued_collectives)

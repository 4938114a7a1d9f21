# SPDX-License-Identifier: Apache-2.0
"""Lookup from the integer id baked into graph ops to the runtime that owns them.

Graph ops can only carry plain scalars, so each compiled engine's runtime gets an id. The map holds weak
references: a runtime lives exactly as long as its engine, and several engines in one process never see
each other's state.
"""
import itertools
import weakref
from typing import List

_runtimes: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_next_id = itertools.count(1)


def register(runtime: object) -> int:
    runtime_id = next(_next_id)
    _runtimes[runtime_id] = runtime
    return runtime_id


def lookup(runtime_id: int):
    runtime = _runtimes.get(runtime_id)
    if runtime is None:
        raise RuntimeError(f"deepspeed-compile runtime {runtime_id} is gone: its engine was destroyed while a "
                           "graph compiled for it still runs")
    return runtime


def live() -> List[object]:
    return list(_runtimes.values())


def backward_after_its_step() -> RuntimeError:
    """The error for a compiled backward that runs after the engine ended its step's backward: a runtime ends the
    backward of every forward run since the last one at the first ``engine.backward()``, so a second backward for
    one of those forwards finds its parameters put back for eager ZeRO."""
    return RuntimeError(
        "deepspeed-compile: a compiled graph's backward ran after engine.backward() had ended the backward of the "
        "forwards before it. With DeepCompile, one engine.backward() covers every forward run since the last "
        "backward: two forwards whose losses are back-propagated separately (forward, forward, backward, backward), "
        "or one loss back-propagated twice (retain_graph=True), are not supported. Sum the losses into one "
        "engine.backward(), or run each forward's backward before the next forward (gradient accumulation does "
        "that)")

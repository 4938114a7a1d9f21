# SPDX-License-Identifier: Apache-2.0
"""Switch a ZeRO-3 engine's eager machinery off while its graphs gather, release and reduce, and back on.

Off while compiled: ZeRO-3's module fetch/release hooks (they would gather on top of the graph ops and break
the graph) and its gradient-accumulation hooks (gradients are reduced inside the backward graph). The engine's
own forward hooks and gradient all-reduce are switched by the engine itself (``_set_deepcompile_active``).

ZeRO-3 also replaces ``torch.nn.functional.linear`` for the whole process (``zero.Init``) with a wrapper whose
autograd function gathers the weight in its backward; dynamo cannot trace that. It is left in place: dynamo is told
(``torch.compiler.substitute_in_graph``) to trace it as the linear it computes, inside compiled graphs only, where
the weight is the graph's own gather. Code run eagerly keeps ZeRO-3's wrapper. The substitution (``effects.py``) is
registered once per process and holds for every engine alike, so no engine changes what another one sees.

Code outside the engine may put ZeRO-3's module hooks back while DeepCompile is active: TRL generates between
training steps inside ``GatheredParameters`` and then calls the offload's ``_register_deepspeed_module`` again. Left
in place, those hooks would gather on top of the graphs' ops and, being new closures every time, fail dynamo's
guards and recompile each step until dynamo gives up and runs the model eagerly. :func:`drop_reregistered` takes
them off again before each forward.
"""
from deepspeed.utils import logger

from .. import effects

_OFF = "_dsc_eager_hooks_off"


def _offload(engine):
    """ZeRO-3's module-hook owner: the optimizer's ``parameter_offload``, or, in an engine built without an
    optimizer (for inference: Trainer's ``evaluate()`` before any training), the engine's ``DeepSpeedZeRoOffload``
    itself."""
    optimizer = engine.optimizer
    return getattr(optimizer, "parameter_offload", optimizer)


def switch_off(engine) -> None:
    effects.trace_zero3_linear_as_linear()  # once per process (effects.py)
    if getattr(engine, _OFF, False):
        return
    optimizer, offload = engine.optimizer, _offload(engine)
    offload.fwd_pre_hook.remove()
    _remove_module_hooks(offload)
    for hooks in (getattr(optimizer, "_grad_acc_hooks", []), getattr(optimizer, "_leaf_module_hooks", [])):
        for hook in hooks:
            hook.remove()
        hooks.clear()
    setattr(engine, _OFF, True)


def _remove_module_hooks(offload) -> None:
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks.clear()
    offload.backward_hooks.clear()


def drop_reregistered(engine) -> None:
    """Take off ZeRO-3 module hooks that something re-registered since :func:`switch_off` (no-op when none)."""
    if not getattr(engine, _OFF, False):
        return
    offload = _offload(engine)
    if offload.forward_hooks or offload.backward_hooks:
        logger.info(f"deepspeed-compile: removing {len(offload.forward_hooks)} forward and "
                    f"{len(offload.backward_hooks)} backward ZeRO-3 module hooks registered again while "
                    f"DeepCompile is active (its graphs gather and release the parameters)")
        _remove_module_hooks(offload)


def switch_on(engine) -> None:
    if not getattr(engine, _OFF, False):
        return
    _offload(engine).setup_zero_stage3_hooks()
    if hasattr(engine.optimizer, "create_reduce_and_remove_grad_hooks"):
        engine.optimizer.create_reduce_and_remove_grad_hooks()
    setattr(engine, _OFF, False)

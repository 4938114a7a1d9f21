"""Switch a ZeRO-3 engine's eager machinery off while its graphs gather, release and reduce, and back on.

Off while compiled: ZeRO-3's module fetch/release hooks (they would gather on top of the graph ops and break
the graph), its gradient-accumulation hooks (gradients are reduced inside the backward graph), and the
``F.linear`` replacement ZeRO-3 installs at ``zero.Init`` (dynamo breaks the graph on it). The engine's own
forward hooks and gradient all-reduce are switched by the engine itself (``_set_deepcompile_active``).
"""
import torch

from deepspeed.runtime.zero.linear import zero3_linear_wrap
from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

_STATE = "_dsc_eager_hooks_off"


def _original_linear():
    return getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)


def switch_off(engine) -> None:
    if getattr(engine, _STATE, False):
        return
    optimizer = engine.optimizer
    offload = optimizer.parameter_offload
    offload._remove_module_hooks()
    offload.forward_hooks.clear()
    offload.backward_hooks.clear()
    for hook in optimizer._grad_acc_hooks:
        hook.remove()
    optimizer._grad_acc_hooks.clear()
    for hook in optimizer._leaf_module_hooks:
        hook.remove()
    optimizer._leaf_module_hooks.clear()
    linear_was_wrapped = torch.nn.functional.linear is zero3_linear_wrap
    if linear_was_wrapped and _original_linear() is not None:
        torch.nn.functional.linear = _original_linear()
    setattr(engine, _STATE, {"linear_was_wrapped": linear_was_wrapped})


def switch_on(engine) -> None:
    state = getattr(engine, _STATE, False)
    if not state:
        return
    optimizer = engine.optimizer
    optimizer.parameter_offload.setup_zero_stage3_hooks()
    optimizer.create_reduce_and_remove_grad_hooks()
    if state["linear_was_wrapped"]:
        torch.nn.functional.linear = zero3_linear_wrap
    setattr(engine, _STATE, False)

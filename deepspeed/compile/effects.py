# SPDX-License-Identifier: Apache-2.0
"""Every effect deepspeed-compile has on the process beyond the engines it compiles, installed here and only here.

An engine's own changes (its runtime, stand-ins, hooks on its modules and optimizer) come and go with the engine
(``adapters.py``). The effects below outlive any engine: they change what torch or DeepSpeed do for every caller in
the process, so each is listed with why, installed by one function of this module, and called from the place named.
``tests/unit/compile/test_effects.py`` checks that no other module calls the mechanisms they use.

========================  ==================================================================  ========================
effect                    why                                                                 installed by, from
========================  ==================================================================  ========================
``deepspeed.compile``     stock DeepSpeed ships a ``deepspeed/compile`` package of its own; a  ``_deepspeed_compile_hook
name precedence           meta-path finder makes the name resolve to this package, at          .install``, by the
                          interpreter start, so it never writes over DeepSpeed's files         ``.pth`` file (setup.py)
``dsc::`` graph ops       the ops the graphs carry (gather, release, reduce, the sequence and  :func:`custom_op`,
                          tensor groups' collectives) and their untraced twins must be known   :func:`op_library`,
                          to the dispatcher before any graph is traced or run; and             :func:`register_fake`,
                          ``autotp::gather_from_tp_region``, which DeepSpeed's AutoTP layers
                          call by name from stock's ``deepspeed.compile``
                                                                                               :func:`mark_side_effect`;
                                                                                               ``runtime/ops.py`` at
                                                                                               import
``dsc_native::`` ops      the native cast + all-gather (a JIT-built library) and the fake      :func:`load_native_ops`;
                          kernels tracing needs                                                ``native/gather.py``, at
                                                                                               first use
frames dynamo skips       ZeRO-3's parameter getter (and what it calls) must run as Python     :func:`skip_frames`;
                          when eager code reads a parameter, and our own helpers that gather   ``runtime/
                          for a caller run as Python must never become frames of their own;    eager_access.py`` at each
                          ``torch._dynamo.reset()`` forgets it, so it is set at every forward  forward
ZeRO-3's ``linear``       ``zero.Init`` replaces ``F.linear`` process-wide with a wrapper      :func:`trace_zero3_linear
traced as ``linear``      dynamo cannot trace; inside compiled graphs only, it is traced as    _as_linear`;
                          the linear it computes (eager code keeps ZeRO-3's wrapper)           ``driver/eager_hooks.py``
DeepSpeed's checkpoint    ``deepspeed.checkpointing.checkpoint`` is dynamo-disabled; inside a  :func:`substitute_in_
traced as torch's         DeepCompile forward it is traced as torch's checkpoint               graph`;
                                                                                               ``integrations/
                                                                                               ds_checkpointing.py``
dynamo's recompile-limit  a frame past the limit runs uncompiled on one rank only; the         :func:`watch_recompile_
check wrapped             engine must hear of it first, to make the ranks agree                limit`;
                                                                                               ``engine_state.py``
========================  ==================================================================  ========================

Each installer is idempotent where it can be called more than once. None is undone: they hold for every engine
alike, so no engine changes what another one sees.
"""
import functools
from typing import Callable, Iterable, Optional

import torch

# the effects above, by name: (installer, the module that calls it). test_effects.py checks both against the code
EFFECTS = {
    "name precedence": ("_deepspeed_compile_hook.install", "setup.py (the .pth file)"),
    "graph ops": ("custom_op, op_library, register_fake, mark_side_effect", "runtime/ops.py"),
    "native ops": ("load_native_ops", "native/gather.py"),
    "frames dynamo skips": ("skip_frames", "runtime/eager_access.py"),
    "ZeRO-3 linear traced as linear": ("trace_zero3_linear_as_linear", "driver/eager_hooks.py"),
    "DeepSpeed checkpoint traced as torch's": ("substitute_in_graph", "integrations/ds_checkpointing.py"),
    "recompile-limit check wrapped": ("watch_recompile_limit", "engine_state.py"),
}


# ----- graph ops ---------------------------------------------------------------------------------------------
def custom_op(name: str, mutates_args) -> Callable:
    """``torch.library.custom_op(name, mutates_args=...)``: the decorator that defines one of the graph ops. Its fake
    and autograd kernels are registered on the op object it returns (``op.register_fake``)."""
    return torch.library.custom_op(name, mutates_args=mutates_args)


def op_library(namespace: str) -> "torch.library.Library":
    """A fragment of ``namespace`` to define more ops in (the graph ops' untraced twins)."""
    return torch.library.Library(namespace, "FRAGMENT")


def register_fake(name: str, fake: Callable, lib: Optional["torch.library.Library"] = None) -> None:
    torch.library.register_fake(name, fake, lib=lib)


def mark_side_effect(op) -> None:
    """FX must keep ``op`` even where nothing reads its result: its effect is what it does (a reduction)."""
    torch.fx.node.has_side_effect(op)


def load_native_ops(load: Callable[[], None], fakes: dict) -> Optional[str]:
    """Load the native library (``load()``: its builder's JIT build and load), then give its ops (name -> fake
    kernel) their fake kernels. Returns why not, where the library did not register every one of them."""
    load()
    missing = [name for name in fakes if not hasattr(getattr(torch.ops, name.split("::")[0]), name.split("::")[1])]
    if missing:
        return f"the library was loaded but did not register {', '.join(missing)}"
    for name, fake in fakes.items():
        torch.library.register_fake(name)(fake)
    return None


# ----- dynamo ------------------------------------------------------------------------------------------------
def skip_frames(codes: Iterable, with_callees: bool) -> None:
    """Dynamo never starts a frame at these code objects (``with_callees``: nor in anything they call); it still
    inlines them inside compiled frames."""
    from torch._dynamo.types import FrameAction, FrameExecStrategy
    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP if with_callees else FrameAction.DEFAULT)
    for code in codes:
        torch._C._dynamo.eval_frame.set_code_exec_strategy(code, strategy)


def substitute_in_graph(original: Callable) -> Callable:
    """The decorator that makes dynamo trace the decorated function wherever ``original`` is called."""
    return torch._dynamo.substitute_in_graph(original, skip_signature_check=True)


@functools.cache
def trace_zero3_linear_as_linear() -> None:
    """ZeRO-3's ``zero3_linear_wrap`` traced, inside compiled graphs, as ``torch._C._nn.linear``."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    @substitute_in_graph(zero3_linear_wrap)
    def _linear(input, weight, bias=None):
        return torch._C._nn.linear(input, weight, bias)


_WATCHING = "_deepspeed_compile_on_limit"


def watch_recompile_limit(on_limit: Callable[[str], None]) -> None:
    """Call ``on_limit(cause)`` whenever dynamo finds a frame past its recompile limit (``exceeds_recompile_limit``,
    as ``convert_frame`` calls it), on the thread about to run the frame uncompiled, with the limit's name and value;
    idempotent."""
    from torch._dynamo import convert_frame
    original = convert_frame.exceeds_recompile_limit
    if getattr(original, _WATCHING, None) is on_limit:
        return
    original = getattr(original, "__wrapped__", original)

    def exceeds_recompile_limit(*args, **kwargs):
        exceeded, limit_type = original(*args, **kwargs)
        if exceeded:
            on_limit(f"torch._dynamo.config.{limit_type} ({getattr(torch._dynamo.config, limit_type)}) at a frame "
                     "of the model (a new input shape): dynamo runs that frame uncompiled on this rank")
        return exceeded, limit_type

    exceeds_recompile_limit.__wrapped__ = original
    setattr(exceeds_recompile_limit, _WATCHING, on_limit)
    convert_frame.exceeds_recompile_limit = exceeds_recompile_limit

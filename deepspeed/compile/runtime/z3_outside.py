# SPDX-License-Identifier: Apache-2.0
"""Calls of ZeRO-3 submodules outside any forward.

Eager ZeRO-3 gathers a module's parameters whenever the module is called, so code may call a submodule itself
between steps: an embedding for ``inputs_embeds``, the backbone of a model with a head, ``model.forward(...)``. Under
DeepCompile ZeRO-3's module hooks are off, so between forwards every submodule that owns parameters carries two hooks
of ours instead: its call, outermost, runs as a forward of its own (the runtime's forward context with ``outside``:
parameters read are gathered on access, their gradients reduced in the next backward, all released after it, or at
once under no_grad), uncompiled as in eager ZeRO-3. A module without parameters of its own (a backbone) needs none:
the calls it makes are hooked. The compiled forward takes the hooks off first, since dynamo must not trace them, and
puts them back after (two hooks per such module and step; the paired step-time benchmarks did not move,
docs/capture.md). The root module is not hooked: its compiled call enters the forward context itself
(``engine_state.direct_call_context``).
"""
from contextlib import ExitStack
from typing import Callable, List, Optional

import torch


class OutsideCalls:
    """Owns the hooks on the submodules that own parameters and the state of the outside call running now.
    ``starts_forward()`` returns the context of a forward of its own, or None where the call belongs to something
    running already (a forward, a backward recomputing a checkpointed module, an engine that left DeepCompile)."""

    def __init__(self, root: torch.nn.Module, starts_forward: Callable[[], Optional[object]]):
        self._owners = [m for m in root.modules()
                        if m is not root and any(True for _ in m.parameters(recurse=False))]
        self._starts_forward = starts_forward
        self._hooks: List = []
        self._depth = 0  # nested submodule calls of the outside call running now
        self._exit: Optional[ExitStack] = None

    def install(self) -> None:
        if self._hooks:
            return
        for module in self._owners:
            self._hooks.append(module.register_forward_pre_hook(self._call_starts))
            self._hooks.append(module.register_forward_hook(self._call_ends, always_call=True))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _call_starts(self, module, args) -> None:
        if self._depth == 0:
            context = self._starts_forward()
            if context is None:
                return
            exit_stack = ExitStack()
            exit_stack.enter_context(context)
            self._exit = exit_stack
        self._depth += 1

    def _call_ends(self, module, args, output) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            exit_stack, self._exit = self._exit, None
            exit_stack.close()

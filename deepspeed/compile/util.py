# SPDX-License-Identifier: Apache-2.0
"""Entry point (stock ``engine.py`` imports it by name, at ``import deepspeed``): support check, the native
handle the engine initializes, and the backward prologue / epilogue of the engines' runtimes.

Everything here must import without CUDA or a built native op.
"""
import torch

from .runtime import registry


def is_deepcompile_supported() -> bool:
    """DeepCompile needs torch >= 2.6 (custom ops, min-cut recompute tags); CPU and CUDA are both supported."""
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 6)


class DeepCompileHandle:
    """The object the engine's ``_initialize_deepcompile_native`` expects. State is per engine in this module
    (the runtime created by ``init_z3``), so there is no process-wide native state to set up or tear down."""

    def init(self, group, config, bucket_size) -> None:
        return None

    def cleanup(self) -> None:
        return None


_HANDLE = DeepCompileHandle()


def get_deepcompile_handle() -> DeepCompileHandle:
    return _HANDLE


def deepcompile_backward_prologue(is_gradient_accumulation_boundary: bool) -> None:
    """Called by the engine before backward: tell each runtime with a forward in flight whether this backward
    ends a gradient-accumulation cycle."""
    for runtime in registry.live():
        runtime.backward_prologue(bool(is_gradient_accumulation_boundary))


def deepcompile_backward_epilogue() -> None:
    """Called by the engine after backward: flush pending gradient reductions of each runtime in flight; where the
    backward ended a gradient-accumulation cycle, hand the host memory it freed back to the OS before the optimizer
    step (``runtime/host_memory.py``)."""
    for runtime in registry.live():
        runtime.end_backward()

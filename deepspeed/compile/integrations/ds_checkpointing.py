# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's activation checkpointing, compiled inside DeepCompile's graphs.

DeepSpeed wraps ``deepspeed.checkpointing.checkpoint`` in ``torch._disable_dynamo`` (a workaround for eager ZeRO-3's
module hooks under plain ``torch.compile``), so dynamo never traces the function it checkpoints. Under DeepCompile every
block a model checkpoints that way ran eagerly: its parameters were gathered on access one at a time, blocking, and
held until backward ended, so at ZeRO-3 the whole model was gathered at once where eager ZeRO-3 holds one module.

Inside a DeepCompile forward, dynamo now traces the call as torch's checkpoint
(``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, by ``torch._dynamo.substitute_in_graph``): the
checkpointed ops are tagged for recomputation in the joint graph, which min-cut honours, so backward recomputes them as
DeepSpeed's function would, and the graph gathers and releases their parameters like any others. DeepSpeed's
``non_reentrant_checkpoint`` is traced the same way. Outside a DeepCompile forward (plain ``torch.compile``, another
engine) the substitute calls DeepSpeed's own function, uncompiled, as before.

What DeepSpeed's function does beyond recomputation is not reproduced in a compiled graph: ``cpu_checkpointing`` (the
checkpointed inputs moved to the host) and ``partition_activations`` (split across model-parallel ranks) keep the
inputs whole on the device; the engine warns when either is set.

Any checkpointed region (torch's, Hugging Face's gradient checkpointing, DeepSpeed's traced as torch's) may mutate
Python state around its computation. Eager checkpointing runs that Python again when backward recomputes the
region; a compiled graph recomputes only tensor ops. By default dynamo may refuse such a region (a graph break: the
region and its parameters run eagerly, gathered on access); it does not refuse every mutation (a toy region setting
and resetting a global holder compiled), but it refused transformers'. Inside a DeepCompile forward it is traced instead, its
Python side effects applied once, in forward (``skip_fwd_side_effects_in_bwd_under_checkpoint``). That is what
``transformers`` >= 5.25 needs: with the ``kernels`` package it requires, every attention layer sets and resets a
module-level context variable around its forward (``use_kernelized_func``), so under gradient checkpointing each
decoder layer broke the graph and ran uncompiled. A set-and-reset leaves nothing to replay.

``transformers`` also logs one-time notices from inside forward (``Logger.warning_once``, which it adds to every
logger), and dynamo breaks the graph at a logger call it is not told to ignore. Two reach most users: GPT-2's loss
function logs on every call that its ``loss_type`` is unset, so a GPT-2 forward with labels compiled as two graphs,
the model and then its loss; and under gradient checkpointing every checkpointed layer logs that it turns off
``use_cache`` (which a pretrained config sets, unless Trainer or the user turned it off), so such a model compiled
as a graph a layer, with no gathers started ahead across layers. Inside a DeepCompile forward dynamo ignores
``warning_once`` (``ignore_logging_functions``): compiled frames do not print these notices (eager ZeRO-3 and
frames dynamo runs as Python still do).
"""
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from .. import effects
from . import transformers

_forwards = 0  # DeepCompile forwards running now; dynamo reads this (and guards on it) when it traces a substitute
_installed = False


@contextmanager
def deepcompile_forward() -> Iterator[None]:
    """Around one DeepCompile forward: DeepSpeed's checkpoint functions called in it are traced as torch's, a
    checkpointed region's Python side effects are applied once, in forward, and ``transformers``' one-time warnings
    do not break the graph (see the module docstring)."""
    global _forwards
    _forwards += 1
    try:
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True,
                                        ignore_logging_functions=transformers.ignored_logging()):
            yield
    finally:
        _forwards -= 1


def _as_deepspeed_returns(outputs):
    """DeepSpeed's checkpoint functions return a lone output by itself and several as a tuple, whatever container
    the checkpointed function returned them in."""
    if torch.is_tensor(outputs):
        return outputs
    outputs = tuple(outputs)
    return outputs[0] if len(outputs) == 1 else outputs


def _substitute(original: Callable) -> None:
    @torch._disable_dynamo
    def run_deepspeeds(function, *args, **kwargs):
        return original(function, *args, **kwargs)

    @effects.substitute_in_graph(original)
    def traced(function, *args, **kwargs):
        if not _forwards:  # not a DeepCompile forward: DeepSpeed's own function, run eagerly as before
            return run_deepspeeds(function, *args, **kwargs)
        return _as_deepspeed_returns(torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                                                       **kwargs))


def install() -> None:
    """Register the substitutes with dynamo, once per process (before the first DeepCompile forward is traced)."""
    global _installed
    if _installed:
        return
    from deepspeed.runtime.activation_checkpointing import checkpointing
    _substitute(checkpointing.checkpoint)
    _substitute(checkpointing.non_reentrant_checkpoint)
    _installed = True


def unsupported_settings(ds_config) -> list:
    """The ``activation_checkpointing`` settings a compiled checkpoint does not follow (see the module docstring)."""
    settings = getattr(ds_config, "activation_checkpointing_config", None)
    return [name for name in ("cpu_checkpointing", "partition_activations") if getattr(settings, name, False)]

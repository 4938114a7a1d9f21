# SPDX-License-Identifier: Apache-2.0
"""Compile a model block by block (``"compile": {"regions": "blocks"}``): one compiled graph serves every block.

A model's repeated blocks are the members of an ``nn.ModuleList`` that holds two or more modules of one class (a
transformer's layers), outermost lists only. Each block's ``forward`` becomes a trampoline that dynamo does not
trace (``torch.compiler.disable``): the model's own frame breaks there and the trampoline calls the block class's
``forward``, compiled on its own with the engine's backend. Every block of a class runs that one compiled function;
dynamo guards a module's parameters on their metadata, so the graph compiled for the first block serves all of them
(the graph ops find their parameters from the graph inputs, ``runtime/ops.py``): the backend lowers and generates code
for one block instead of the whole model. What the model does outside its blocks (embedding, final norm, head, loss)
is compiled by the engine's own compile of the module where dynamo can, as separate frames when the blocks sit in a
loop dynamo cannot resume inside (it then runs that loop's frame as Python and compiles the frames it calls). Under
inductor those graphs outside the blocks compile with the eager backend (``engine_state._activate``). The
parameter-owning leaf modules outside the blocks (embedding, final norm, head) are compiled as regions of their own
too at ZeRO stage 3, since dynamo never starts a frame inside ``torch.nn``; only parameters that the Python frame
reads itself are gathered on access (``runtime/eager_access.py``).
"""
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..adapters import ModuleForward
from ..runtime.eager_access import BLOCK_TRAMPOLINE, gather_for_caller

_TRAMPOLINE = "_dsc_block_trampoline"  # marks a block forward installed here


def repeated_blocks(module: nn.Module) -> List[nn.Module]:
    """The members of every outermost ``nn.ModuleList`` of two or more modules of one class, in module order."""
    blocks: List[nn.Module] = []
    chosen: List[str] = []
    for name, child in module.named_modules():
        if any(name.startswith(prefix + ".") for prefix in chosen):
            continue
        if isinstance(child, nn.ModuleList) and len(child) >= 2 and len({type(m) for m in child}) == 1:
            chosen.append(name)
            blocks.extend(child)
    return blocks


def check(module: nn.Module) -> None:
    """Refuse ``regions='blocks'`` for a model without repeated blocks (``ValueError`` naming the option), before
    anything changes. Any ZeRO stage serves: every graph op finds its parameter from the graph's inputs."""
    if not repeated_blocks(module):
        raise ValueError("compile.regions='blocks': the model has no repeated blocks (an nn.ModuleList of two or more "
                         "modules of one class) to compile one by one; use regions='model'")


def install(module: nn.Module, backend: Callable, leaf_regions: bool,
            compile_kwargs: Optional[Dict] = None, leaf_backend: Optional[Callable] = None) -> List[nn.Module]:
    """Compile the repeated blocks of ``module`` as graphs of their own (one compiled function per block class), and
    with ``leaf_regions`` (ZeRO-3: ``stages.ShardedGraphs``) the parameter-owning modules outside them as regions of
    their own (:func:`outer_leaves`); returns
    the blocks (``check`` has accepted the module). ``compile_kwargs``: ``torch.compile``'s ``fullgraph`` and
    ``dynamic`` for these compiles, as ``engine.compile(compile_kwargs=...)`` gave them. A block may hand one of its
    parameters back to the model's frame, which often runs as Python, and dynamo returns it holding its stand-in: the
    trampoline gathers it at ZeRO-3 (``eager_access.gather_for_caller``, as any module's forward does there).
    ``leaf_backend`` (default ``backend``) compiles the leaf regions."""
    blocks = repeated_blocks(module)
    compiled: Dict[Tuple[type, Callable], Callable] = {}

    def compiled_forward(cls: type, with_backend: Callable) -> Callable:
        # by backend too: a leaf of a block's class (a Linear head beside blocks of Linears) keeps the leaves' backend
        key = (cls, with_backend)
        if key not in compiled:
            compiled[key] = torch.compile(cls.forward, backend=with_backend, **(compile_kwargs or {}))
        return compiled[key]

    for block in blocks:
        ModuleForward.set(block, _trampoline(compiled_forward(type(block), backend), block))
    for leaf in outer_leaves(module, blocks) if leaf_regions else ():
        ModuleForward.set(leaf, _compiled_leaf(compiled_forward(type(leaf), leaf_backend or backend), leaf))
    return blocks


def outer_leaves(module: nn.Module, blocks: List[nn.Module]) -> List[nn.Module]:
    """Modules outside the blocks with parameters and no submodules (an embedding, a final norm, a head). The model's
    own frame often runs as Python (dynamo cannot resume the loop over the blocks), and dynamo never starts a frame
    inside ``torch.nn`` itself: an ``nn.Embedding`` called from there would read its weight eagerly, gathered on
    access and held until backward ends (``runtime/eager_access.py``). Compiled as regions of their own they gather
    in the graph and release after use. ZeRO-1/2 parameters are replicated, nothing to gather: there a weight tied
    between such a region and Python code (a head computed with the embedding's weight) would get its compiled
    gradient reduced before its eager one arrives, which ZeRO-2 cannot take (``runtime/z12.py``)."""
    inside = {id(m) for block in blocks for m in block.modules()}
    return [m for m in module.modules()
            if id(m) not in inside and not m._modules and any(True for _ in m.parameters(recurse=False))]


def uninstall(module: nn.Module) -> None:
    """Give every block its class's ``forward`` back."""
    for block in module.modules():
        ModuleForward.clear(block, lambda forward: getattr(forward, _TRAMPOLINE, False))


def _compiled_leaf(compiled: Callable, leaf: nn.Module) -> Callable:
    # not disabled: a caller dynamo traces inlines the module as before (a nested compiled function is traced
    # through); called from Python, it runs as a compiled region of its own
    def forward(*args, **kwargs):
        return compiled(leaf, *args, **kwargs)

    setattr(forward, _TRAMPOLINE, True)
    return forward


def _trampoline(compiled: Callable, block: nn.Module) -> Callable:
    def forward(*args, **kwargs):
        output = compiled(block, *args, **kwargs)
        gather_for_caller(output)  # no-op outside a ZeRO-3 DeepCompile forward
        return output

    forward.__name__ = forward.__qualname__ = BLOCK_TRAMPOLINE  # what dynamo's graph break names (eager_access)
    forward = torch.compiler.disable(forward, recursive=True)
    setattr(forward, _TRAMPOLINE, True)
    return forward

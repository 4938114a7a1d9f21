"""Compile a model block by block (``"compile": {"regions": "blocks"}``): one compiled graph serves every block.

A model's repeated blocks are the members of an ``nn.ModuleList`` that holds two or more modules of one class (a
transformer's layers), outermost lists only. Each block's ``forward`` becomes a trampoline that dynamo does not
trace (``torch.compiler.disable``): the model's own frame breaks there and the trampoline calls the block class's
``forward``, compiled on its own with the engine's backend. Every block of a class runs that one compiled function;
dynamo guards a module's parameters on their metadata, so the graph compiled for the first block serves all of them
(the graph ops find their parameters from the graph inputs, ``runtime/ops.py``): the backend lowers and generates code
for one block instead of the whole model. What the model does outside its blocks (embedding, final norm, head, loss)
is compiled by the engine's own compile of the module where dynamo can, as separate frames when the blocks sit in a
loop dynamo cannot resume inside (it then runs that loop's frame as Python and compiles the frames it calls), and
parameters read by Python there are gathered on access (``runtime/eager_access.py``).
"""
from typing import Callable, Dict, List

import torch
from torch import nn

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


def install(module: nn.Module, backend: Callable) -> List[nn.Module]:
    """Compile the repeated blocks of ``module`` as graphs of their own (one compiled function per block class);
    returns the blocks (``check`` has accepted the module)."""
    blocks = repeated_blocks(module)
    compiled: Dict[type, Callable] = {}
    for block in blocks:
        cls = type(block)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, backend=backend)
        block.forward = _trampoline(compiled[cls], block)
    return blocks


def uninstall(module: nn.Module) -> None:
    """Give every block its class's ``forward`` back."""
    for block in module.modules():
        if getattr(block.__dict__.get("forward"), _TRAMPOLINE, False):
            del block.forward


def _trampoline(compiled: Callable, block: nn.Module) -> Callable:
    @torch.compiler.disable(recursive=True)
    def forward(*args, **kwargs):
        return compiled(block, *args, **kwargs)

    setattr(forward, _TRAMPOLINE, True)
    return forward

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
from typing import Callable, Dict, List, Optional

import torch
from deepspeed.utils import logger
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


def kv_cache_warning(module: nn.Module) -> Optional[str]:
    """Why a ``transformers`` model whose config keeps ``use_cache=True`` compiles badly block by block, or None.
    Training with a KV cache (the config's default) hands every layer the cache and the layer updates its own entry
    (``layer_idx``): dynamo guards on that entry's state, so it compiles the block once per layer, and the layers past
    ``torch._dynamo.config.recompile_limit`` run uncompiled."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "use_cache", False) is True and hasattr(config, "num_hidden_layers"):
            return (f"compile.regions='blocks': {type(sub).__name__}.config.use_cache is True. Training with a KV cache "
                    "makes dynamo compile the block once per layer (each updates its own cache entry), and the layers "
                    f"past torch._dynamo.config.recompile_limit ({torch._dynamo.config.recompile_limit}) run "
                    "uncompiled. Set model.config.use_cache = False for training (or pass use_cache=False).")
    return None


def install(module: nn.Module, backend: Callable) -> List[nn.Module]:
    """Compile the repeated blocks of ``module`` as graphs of their own (one compiled function per block class);
    returns the blocks (``check`` has accepted the module)."""
    warning = kv_cache_warning(module)
    if warning is not None:
        logger.warning(f"deepspeed-compile: {warning}")
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

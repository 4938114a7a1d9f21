# SPDX-License-Identifier: Apache-2.0
"""``transformers``: what its models do that DeepCompile has to meet (a KV cache while training, one-time log notices
inside forward; ``docs/capture.md``)."""
import logging
from typing import Optional

import torch
from torch import nn


def kv_cache_warning(module: nn.Module) -> Optional[str]:
    """Why a ``transformers`` model whose config keeps ``use_cache=True`` compiles badly block by block, or None.
    Training with a KV cache (the config's default) hands every layer the cache and the layer updates its own entry
    (``layer_idx``): dynamo guards on that entry's state, so it compiles the block once per layer, and the layers past
    ``torch._dynamo.config.recompile_limit`` run uncompiled."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "use_cache", False) is True and hasattr(config, "num_hidden_layers"):
            return (f"compile.regions='blocks': {type(sub).__name__}.config.use_cache is True. Training with a KV "
                    "cache makes dynamo compile the block once per layer (each updates its own cache entry), and the "
                    f"layers past torch._dynamo.config.recompile_limit ({torch._dynamo.config.recompile_limit}) run "
                    "uncompiled. Set model.config.use_cache = False for training (or pass use_cache=False).")
    return None


def ignored_logging() -> set:
    """Dynamo's ignored logging functions, with ``transformers``' ``Logger.warning_once`` once it is installed."""
    ignored = torch._dynamo.config.ignore_logging_functions
    warning_once = getattr(logging.Logger, "warning_once", None)
    return ignored if warning_once is None or warning_once in ignored else ignored | {warning_once}

# SPDX-License-Identifier: Apache-2.0
"""deepspeed-compile: DeepCompile for ZeRO stage 3, as a drop-in ``deepspeed.compile`` module.

Switched on by ``"compile": {"deepcompile": true}`` in a ZeRO-3 ds_config and ``engine.compile()``. The joint
forward/backward graph is captured with AOTAutograd, parameter aliases and downcasts are marked for
recomputation, the graph is split with min-cut rematerialization, and all-gather / release / reduce ops are
placed into the forward and backward graphs. See ``docs/`` for the design.

Importing this package must stay cheap and must work without CUDA or a built native op: DeepSpeed imports
parts of it at ``import deepspeed`` time.
"""
import os

from deepspeed.utils.logging import logger

__version__ = "0.1.0"
IMPLEMENTATION = "deepspeed-compile"

# Logged once, at import, through DeepSpeed's logger: which deepspeed.compile is active.
logger.info(f"deepspeed.compile: {IMPLEMENTATION} {__version__} is active "
            f"({os.path.dirname(os.path.abspath(__file__))})")

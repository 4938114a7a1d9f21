# SPDX-License-Identifier: Apache-2.0
"""Accelerate: its regional compilation, adopted as DeepCompile block by block (``docs/config.md``, ``regions``)."""
import sys

from deepspeed.utils import logger

from ..adapters import ModuleCompile
from ..driver import regions

_REGIONS_LOOKED_AT = "_dsc_regions_looked_at"  # the engine attribute: in-place compiles were looked for once


def dynamo_plugin():
    """Accelerate's ``TorchDynamoPlugin`` of this process, if Accelerate is in use and set one up (never imports or
    initializes Accelerate itself)."""
    state = sys.modules.get("accelerate.state")
    if state is None or not state.is_initialized():
        return None
    return getattr(state.AcceleratorState(), "dynamo_plugin", None)  # the shared state Accelerator set up


def adopt_regional_compile(engine) -> bool:
    """Accelerate's regional compilation (``use_regional_compilation``) does not call ``engine.compile()``: it
    compiles each repeated block of ``engine.module`` in place (``nn.Module.compile``), so ``"deepcompile": true`` did
    nothing. At such an engine's first forward its in-place compiles are undone and the engine is compiled with
    DeepCompile block by block (``"regions": "blocks"``), with the backend and settings Accelerate compiled the blocks
    with. Modules compiled in place by other code only get a warning: their backend is not known. Returns whether it
    compiled the engine."""
    if getattr(engine, _REGIONS_LOOKED_AT, False) or engine.is_compiled or not engine.is_deepcompile_enabled():
        return False
    setattr(engine, _REGIONS_LOOKED_AT, True)
    compiled = [m for m in engine.module.modules() if ModuleCompile.compiled_call(m) is not None]
    if not compiled:
        return False
    plugin = dynamo_plugin()
    kwargs = plugin.to_kwargs() if plugin is not None and getattr(plugin, "use_regional_compilation", False) else {}
    backend = kwargs.pop("backend", None)
    if backend not in ("eager", "inductor"):
        reason = (f"Accelerate's dynamo backend {backend!r} is not one DeepCompile runs ('eager', 'inductor')"
                  if backend is not None else "they were not compiled by Accelerate's regional compilation")
        logger.warning(f"deepspeed-compile: 'deepcompile' is set, but engine.compile() was not called and "
                       f"{len(compiled)} module(s) were compiled in place (nn.Module.compile); {reason}. DeepCompile "
                       "is not active: those modules run eager ZeRO under plain torch.compile. Call engine.compile() "
                       "instead; '\"compile\": {\"regions\": \"blocks\"}' compiles block by block")
        return False
    for module in compiled:
        ModuleCompile.set_compiled_call(module, None)
    if engine.module not in compiled and regions.repeated_blocks(engine.module):  # blocks, not the whole model
        engine._config.compile_config.regions = "blocks"
    logger.warning(f"deepspeed-compile: Accelerate compiled {len(compiled)} module(s) in place (regional "
                   f"compilation), which leaves DeepCompile off; DeepCompile compiles the engine instead, "
                   f"regions={engine._config.compile_config.regions!r}, backend={backend!r}")
    engine.compile(backend=backend, compile_kwargs=kwargs)
    return True

# SPDX-License-Identifier: Apache-2.0
"""Entry point (stock ``engine.py`` imports it by name): DeepCompile for ZeRO stages 1 and 2, see
``engine_state.activate_z12`` and ``runtime/z12.py``."""
from .engine_state import activate_z12


def init_z1_and_2(engine, backend, compile_config, compile_kwargs, schedule=None, use_z2: bool = False):
    return activate_z12(engine, backend, compile_config, schedule, stage=2 if use_z2 else 1,
                        compile_kwargs=compile_kwargs)

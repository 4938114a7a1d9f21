# SPDX-License-Identifier: Apache-2.0
"""Entry point (stock ``engine.py`` imports it by name): DeepCompile for ZeRO stage 3, see ``engine_state``."""
from .engine_state import activate_z3


def init_z3(engine, backend, compile_config, compile_kwargs, schedule=None):
    return activate_z3(engine, backend, compile_config, schedule, compile_kwargs)

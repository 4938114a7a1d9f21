# SPDX-License-Identifier: Apache-2.0
"""Entry point (stock ``engine.py`` imports it by name): AutoSP, not implemented."""
from .engine_state import fall_back


def init_autosp(config):
    return fall_back("compile pass 'autosp'", "deepspeed-compile implements the ZeRO-3 pipeline only")

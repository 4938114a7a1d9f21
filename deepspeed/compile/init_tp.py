# SPDX-License-Identifier: Apache-2.0
"""Entry point (stock ``engine.py`` imports it by name): AutoTP, not implemented."""
from .engine_state import fall_back


def init_autotp(module):
    return fall_back("compile pass 'autotp'", "deepspeed-compile implements the ZeRO-3 pipeline only")

# SPDX-License-Identifier: Apache-2.0
"""Entry point (stock ``engine.py`` imports it by name): AutoTP, not implemented."""
from .engine_state import fall_back


def init_autotp(model):
    """Stock's signature (the engine passes its module); this module places AutoTP's collectives in its ZeRO-1/2
    pipelines instead (``engine_state.activate_z12``), reached through the ZeRO entry points."""
    return fall_back("compile pass 'autotp'", "deepspeed-compile implements the ZeRO-3 pipeline only")

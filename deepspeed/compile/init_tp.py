"""Engine entry point for AutoTP: not implemented by this module."""
from .fallback import fall_back


def init_autotp(module):
    return fall_back("compile pass 'autotp'", "deepspeed-compile implements the ZeRO-3 pipeline only")

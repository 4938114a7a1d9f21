"""Engine entry point for AutoSP: not implemented by this module."""
from .fallback import fall_back


def init_autosp(config):
    return fall_back("compile pass 'autosp'", "deepspeed-compile implements the ZeRO-3 pipeline only")

"""Engine entry point for DeepCompile with ZeRO stage 1 or 2: not implemented by this module."""
from .fallback import fall_back


def init_z1_and_2(engine, backend, compile_config, compile_kwargs, schedule=None, use_z2: bool = False):
    return fall_back(f"DeepCompile with ZeRO stage {2 if use_z2 else 1}", "deepspeed-compile implements ZeRO-3 only")

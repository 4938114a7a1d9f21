"""Engine adapter (stock ``engine.py`` imports it by name): DeepCompile for ZeRO stage 1 or 2, not implemented."""
from .engine_state import fall_back


def init_z1_and_2(engine, backend, compile_config, compile_kwargs, schedule=None, use_z2: bool = False):
    return fall_back(f"DeepCompile with ZeRO stage {2 if use_z2 else 1}", "deepspeed-compile implements ZeRO-3 only")

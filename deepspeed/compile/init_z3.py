"""Engine entry point for DeepCompile with ZeRO stage 3: build the runtime and the dynamo backend."""
from .config import CompileConfig, unimplemented_options
from .fallback import fall_back


def check_compile_request(compile_config: CompileConfig, backend: str, schedule) -> None:
    """Refuse what cannot work before any state is changed: a ``ValueError`` naming the argument."""
    if schedule is not None:
        raise ValueError("engine.compile(schedule=...) is not supported by deepspeed-compile: its pipeline is "
                         "fixed (tag, min-cut partition, rewrite, schedule) and configured in the ds_config "
                         "'compile' section; pass schedule=None")
    if backend not in ("eager", "inductor"):
        raise ValueError(f"engine.compile(backend={backend!r}): DeepCompile supports 'eager' and 'inductor'")


def init_z3(engine, backend, compile_config: CompileConfig, compile_kwargs, schedule=None):
    check_compile_request(compile_config, backend, schedule)
    fallback, _ = unimplemented_options(compile_config)
    if fallback:
        return fall_back(f"compile option(s) {fallback}", "offload is not implemented by deepspeed-compile")
    return fall_back("the ZeRO-3 compile pipeline", "not available yet in this version")

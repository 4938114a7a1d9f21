"""Engine entry point for DeepCompile with ZeRO stage 3: build the runtime and the dynamo backend."""
from deepspeed.utils import logger

from .config import CompileConfig, unimplemented_options
from .fallback import fall_back
from .z3_eager_fallback import RUNTIME_ATTR


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
    fallback, ignored = unimplemented_options(compile_config)
    if fallback:
        return fall_back(f"compile option(s) {fallback}", "offload is not implemented by deepspeed-compile")
    if ignored:
        logger.warning(f"deepspeed-compile: compile option(s) {ignored} have no effect in this implementation")

    # imported here: these register the graph ops, which `import deepspeed` must not pay for
    from .capture import eager_hooks
    from .capture.backend import make_backend
    from .runtime.z3 import Z3Runtime

    runtime = Z3Runtime(engine, timeout_s=compile_config.collective_timeout_s, free_on_release=backend == "eager",
                        native_op=compile_config.native_op)
    setattr(engine, RUNTIME_ATTR, runtime)
    eager_hooks.switch_off(engine)
    if engine.fp16_auto_cast():
        # the engine casts inputs to fp16 in the forward pre-hook it removes while DeepCompile is active
        runtime.input_cast_hook = engine.module.register_forward_pre_hook(
            lambda module, args: engine._cast_inputs_half(args))

    def on_failure(err: BaseException) -> None:
        logger.error(f"deepspeed-compile: compiling a graph failed ({type(err).__name__}: {err}); the engine "
                     "runs uncompiled eager ZeRO-3 from the next step on (engine.compile() tries again)")
        deactivate(engine, uncompile=True)

    return make_backend(runtime, compile_config, backend, on_failure)


def deactivate(engine, uncompile: bool = False) -> None:
    """Return ``engine`` to eager ZeRO-3: stand-ins out, eager hooks back on, DeepCompile marked inactive.
    With ``uncompile`` the module's ``torch.compile`` wrapper is dropped too: after a failed compile the eager
    ZeRO-3 hooks must run as plain Python, not be re-traced by dynamo."""
    from .capture import eager_hooks, standins
    runtime = getattr(engine, RUNTIME_ATTR, None)
    if runtime is not None:
        if runtime.input_cast_hook is not None:
            runtime.input_cast_hook.remove()
            runtime.input_cast_hook = None
        runtime.eager.release()
        runtime.eager.remove_grad_hooks()  # eager ZeRO-3's own gradient hooks take over
        standins.uninstall(runtime.params.values())
    eager_hooks.switch_on(engine)
    if engine.is_deepcompile_active():
        engine._set_deepcompile_active(False)
    if uncompile:
        # nn.Module.compile() keeps its wrapper here; the engine records compilation in _is_compiled
        engine.module._compiled_call_impl = None
        engine._is_compiled = False

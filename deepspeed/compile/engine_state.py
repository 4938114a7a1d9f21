# SPDX-License-Identifier: Apache-2.0
"""The engine's DeepCompile state: one :class:`DeepCompileState` per engine, and the only code that creates it,
runs a forward in it, and ends it.

Stock DeepSpeed reaches this module only through thin entry points, files that exist because its ``engine.py``
imports them by name (``docs/design.md`` lists them): ``init_z3`` -> :func:`activate_z3`; ``init_z1_and_2`` ->
:func:`activate_z12`; ``init_sp`` -> :func:`activate_z0` (ZeRO-0 with sequence parallelism); ``init_tp`` ->
:func:`fall_back`; ``z3_eager_fallback`` ->
:func:`forward_context`; ``backend`` -> :class:`PassTimes`. ``report.py`` reads the state for users. Importing this
module must stay cheap (stock DeepSpeed imports it at ``import deepspeed``): the runtime and compiler are imported
when an engine activates. The forward context also adopts Accelerate's regional compilation
(``integrations/accelerate.py``).
"""
import weakref
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, NoReturn, Optional, Union

from deepspeed.utils import logger

from . import compat, effects
from .adapters import ModuleCompile, TensorParallelDeferral
from .integrations import ds_checkpointing
from .composition import check_sequence_parallel
from .config import CompileConfig, unimplemented_options

if TYPE_CHECKING:
    from .driver.compiler import CompileStats
    from .runtime.z0 import Z0Runtime
    from .runtime.z12 import Z12Runtime
    from .runtime.z3 import Z3Runtime

ATTR = "_deepspeed_compile"  # the engine attribute holding its DeepCompileState

# every engine's state while the engine lives: read only by the process-wide pass-time view the engine API asks for
_LIVE: "weakref.WeakSet[DeepCompileState]" = weakref.WeakSet()


@dataclass(eq=False)
class DeepCompileState:
    runtime: "Union[Z3Runtime, Z12Runtime, Z0Runtime]"  # communication and buffers
    stats: "CompileStats"  # what compiling the engine's graphs found
    stage: int = 3  # the ZeRO stage the runtime serves
    # raises StepAbandoned saying which ranks stopped and why, the engine returned to eager ZeRO (set at activation)
    on_stopped: Optional[Callable[[Any], NoReturn]] = None


def state_of(engine, active_only: bool = True) -> Optional[DeepCompileState]:
    """The engine's DeepCompile state; with ``active_only`` None unless the engine runs DeepCompile now."""
    state = getattr(engine, ATTR, None)
    if state is None or (active_only and not engine.is_deepcompile_active()):
        return None
    return state


def runtime_of(engine, active_only: bool = True) -> "Optional[Union[Z3Runtime, Z12Runtime]]":
    state = state_of(engine, active_only)
    return None if state is None else state.runtime


def fall_back(what: str, why: str) -> None:
    """DeepCompile cannot run this configuration: log one clear warning and return ``None``, so that the engine
    compiles with plain ``torch.compile``."""
    logger.warning(f"deepspeed-compile: {what} is not supported ({why}); "
                   "falling back to plain torch.compile without DeepCompile")
    return None


def check_compile_request(compile_config: CompileConfig, backend: str, schedule) -> None:
    """Refuse what cannot work before any state is changed: a ``ValueError`` naming the argument."""
    if schedule is not None:
        raise ValueError("engine.compile(schedule=...) is not supported by deepspeed-compile: its pipeline is "
                         "fixed (tag, min-cut partition, rewrite, schedule) and configured in the ds_config "
                         "'compile' section; pass schedule=None")
    if backend not in ("eager", "inductor"):
        raise ValueError(f"engine.compile(backend={backend!r}): DeepCompile supports 'eager' and 'inductor'")
    if compile_config.release_host_memory is True:
        from .runtime.host_memory import malloc_trim
        if malloc_trim() is None:
            raise ValueError("compile.release_host_memory: true needs the C library's malloc_trim (glibc), which this "
                             "process's C library does not have; set it to \"auto\" or false")


def inductor_settings(backend: str, compile_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The inductor config ``engine.compile(compile_kwargs=...)`` asks for with its ``mode`` and ``options`` (what
    Accelerate passes from ``torch_compile_mode``), resolved and checked as plain ``torch.compile`` resolves them, so
    a bad value raises a ``ValueError`` at ``engine.compile()``, before any step. With the eager backend they change
    nothing, as with torch's own eager backend: a warning says so."""
    mode, options = compile_kwargs.get("mode"), compile_kwargs.get("options")
    if mode == "default":
        mode = None
    if mode is None and not options:
        return {}
    if mode is not None and options:
        raise ValueError("engine.compile(compile_kwargs=...): give 'mode' or 'options', not both (as torch.compile)")
    if backend != "inductor":
        logger.warning(f"deepspeed-compile: compile_kwargs {'mode' if mode else 'options'} set inductor's settings "
                       f"and do nothing with backend={backend!r}")
        return {}
    import torch
    try:
        return dict(torch._TorchCompileInductorWrapper(mode, options, compile_kwargs.get("dynamic")).config)
    except (RuntimeError, ValueError, KeyError) as err:
        raise ValueError(f"engine.compile(compile_kwargs=...): {'mode' if mode else 'options'}: {err}") from err


def warn_static_shapes(compile_kwargs: Dict[str, Any]) -> bool:
    """``dynamic=False``: every new input shape compiles a graph, and a frame past dynamo's ``recompile_limit`` runs
    eagerly. That is exact when every rank falls back at the same step, but ranks fed different lengths (a collator
    padding each rank's batch to its own longest) reach the limit at different steps and issue different collectives
    (a hang, but for ``compile.agree_on_failures``, on by default: ``_agree_on_recompile_limit``). Warn once, at
    ``engine.compile()``; returns whether it warned."""
    if compile_kwargs.get("dynamic") is not False:
        return False
    import torch
    logger.warning("deepspeed-compile: compile_kwargs dynamic=False compiles a graph for every new input shape; a "
                   f"frame past torch._dynamo.config.recompile_limit ({torch._dynamo.config.recompile_limit}) runs "
                   "eagerly, and if the ranks see different lengths they reach that limit at different steps and "
                   "issue different collectives (compile.agree_on_failures, on by default, then stops every rank in "
                   "that step and goes on as eager ZeRO-3). Leave dynamic unset (one dynamic graph serves every "
                   "length) or pad every rank's batches to the same few lengths")
    return True


def _compile_kwargs_settings(backend: str, compile_kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """What ``engine.compile(compile_kwargs=...)`` means for our graphs, checked before any state changes: the
    inductor config of its mode and options, and the warning about static shapes."""
    compile_kwargs = compile_kwargs or {}
    warn_static_shapes(compile_kwargs)
    return inductor_settings(backend, compile_kwargs)


def param_offload_device(engine) -> str:
    """Where ZeRO-3 keeps the parameter shards between uses: ``offload_param.device`` ("none", "cpu" or "nvme")."""
    device = getattr(engine.zero_offload_param(), "device", None)
    return "none" if device is None else str(getattr(device, "value", device))


def _check_options(compile_config: CompileConfig, backend: str, schedule, param_offload: str = "none") -> bool:
    """Refuse a bad request (ValueError) and say whether this module can run the configuration at all.
    ``param_offload``: where ZeRO-3 keeps the parameter shards ("none" for ZeRO-1/2)."""
    check_compile_request(compile_config, backend, schedule)
    if param_offload == "nvme":
        fall_back("zero_optimization.offload_param.device='nvme'", "deepspeed-compile gathers shards kept in "
                  "memory; offload_param to 'cpu' runs with DeepCompile")
        return False
    fallback, ignored = unimplemented_options(compile_config, param_offload)
    if fallback:
        why = "offload is not implemented by deepspeed-compile"
        if "offload_parameters" in fallback and param_offload == "none":
            why += "; at ZeRO-3, zero_optimization.offload_param.device='cpu' keeps the parameter shards on the CPU " \
                   "and runs with DeepCompile"
        fall_back(f"compile option(s) {fallback}", why)
        return False
    if ignored:
        logger.warning(f"deepspeed-compile: compile option(s) {ignored} have no effect in this implementation")
    return True


def unapplied_zeropp_options(zero_config) -> List[str]:
    """ZeRO++ settings of a ZeRO-3 config that DeepCompile's gathers and reduces do not apply (``zero_config`` is the
    engine's ``_config.zero_config``)."""
    names = [name for name in ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                               "zero_quantized_gradients") if getattr(zero_config, name, False)]
    if (getattr(zero_config, "zero_hpz_partition_size", 1) or 1) > 1:
        names.append("zero_hpz_partition_size")
    return names


def _warn_zeropp(engine) -> None:
    names = unapplied_zeropp_options(engine._config.zero_config)
    if names:
        logger.warning(f"deepspeed-compile: ZeRO++ option(s) {names} are not applied by DeepCompile: the compiled "
                       "graphs gather parameters and reduce-scatter gradients unquantized, on the whole data-parallel "
                       "group (hpZ's secondary partition is not used), with eager ZeRO-3's arithmetic without "
                       "ZeRO++. Code run eagerly outside the graphs still gathers through ZeRO-3 itself")


def _check_regions(engine, compile_config: CompileConfig) -> None:
    if compile_config.regions == "blocks":
        from .driver import regions
        regions.check(engine.module)


def _activate(engine, runtime, stage: int, backend: str, compile_config: CompileConfig,
              inductor_config: Dict[str, Any], compile_kwargs: Optional[Dict[str, Any]]) -> Callable:
    from .driver.compiler import CompileStats, make_backend
    from .driver.stages import graphs_of
    from .runtime.agreement import FAILED, StepAbandoned
    from .runtime.host_memory import HostHeap
    state = DeepCompileState(runtime, CompileStats(), stage)
    runtime.host_heap = HostHeap.for_setting(compile_config.release_host_memory, engine.device)
    if compile_config.sequence_parallel:
        _start_sequence_group(engine, runtime, compile_config)
    runtime.peers.agree_on_failures = compile_config.agree_on_failures
    setattr(engine, ATTR, state)
    _LIVE.add(state)
    if engine.fp16_auto_cast():
        # the engine casts inputs to fp16 in the forward pre-hook it removes while DeepCompile is active
        runtime.input_cast_hook = engine.module.register_forward_pre_hook(
            lambda module, args: engine._cast_inputs_half(args))

    def on_failure(err: BaseException, in_place_of_a_graph: bool) -> None:
        cause = f"compiling a graph failed ({type(err).__name__}: {err})"
        logger.error(f"deepspeed-compile: {cause}; the engine runs uncompiled eager ZeRO-{stage} from the next step "
                     "on (engine.compile() tries again)")
        try:
            # the peers must not go on with their graphs either, or the ranks' collectives differ: where the ranks
            # agree before a graph's first collective, this takes the place of the graph's agreement and they stop
            # there; else their next wait on shared memory raises naming this rank (HostComm.on_diverged)
            if in_place_of_a_graph and runtime.peers.agrees_now():
                runtime.peers.agree(FAILED, cause)
            else:
                runtime.peers.post_failure(f"{cause}; it runs uncompiled eager ZeRO-{stage} from the next step on")
        finally:
            deactivate(engine, uncompile=True)

    def on_stopped(outcome) -> NoReturn:
        why = outcome.describe()
        logger.error(f"deepspeed-compile: {why}; every rank stops this step and runs uncompiled eager ZeRO-{stage}")
        deactivate(engine, uncompile=True)
        raise StepAbandoned(f"deepspeed-compile: {why}. Every rank stops this step (skip its engine.backward() and "
                            f"engine.step()) and runs uncompiled eager ZeRO-{stage} from the next step on")

    state.on_stopped = runtime.peers.on_stopped = on_stopped
    if runtime.transport.host is not None:
        runtime.transport.host.on_diverged = lambda why: deactivate(engine, uncompile=True)
    # the engine calls this when DeepCompile is switched off and at destroy: the runtime's segments go then
    engine._deepcompile_dynamo_config_restore = runtime.close
    if compile_config.agree_on_failures:  # dynamo's check wrapped only where it is used
        effects.watch_recompile_limit(_agree_on_recompile_limit)

    compile_graph = make_backend(runtime, state.stats, compile_config, backend, on_failure, inductor_config)
    ds_checkpointing.install()
    ignored = ds_checkpointing.unsupported_settings(engine._config)
    if ignored:
        logger.warning(f"deepspeed-compile: activation_checkpointing settings not followed in compiled graphs: "
                       f"{', '.join(ignored)} (DeepSpeed's checkpoint functions are compiled as "
                       "torch.utils.checkpoint, which recomputes the same ops but keeps the checkpointed inputs whole "
                       "on the device)")
    blocks = compile_config.regions == "blocks"
    _prepare_module_compile(engine, wrap_direct_calls=True, drop_fullgraph=blocks)
    if blocks:
        from .driver import regions
        from .integrations import transformers
        warning = transformers.kv_cache_warning(engine.module)
        if warning is not None:
            logger.warning(f"deepspeed-compile: {warning}")
        compile_kwargs = compile_kwargs or {}
        # the graphs outside the blocks (the model's frame around them, the leaf regions) each hold one embedding,
        # norm, head or loss: little for inductor to fuse, yet a forward and a backward code generation and C++ build
        # each: the eager backend compiles them under inductor
        outside = make_backend(runtime, state.stats, compile_config, "eager", on_failure) if (
            backend == "inductor") else compile_graph
        regions.install(engine.module, compile_graph, graphs_of(runtime).leaf_regions,
                        {key: compile_kwargs[key] for key in ("fullgraph", "dynamic") if key in compile_kwargs},
                        outside)
        return outside
    return compile_graph


def _start_sequence_group(engine, runtime, compile_config: CompileConfig) -> None:
    """``"passes": ["autosp"]``: the runtime's sequence group of ``sequence_parallel_size`` ranks
    (``runtime/sequence.py``); the graphs are rewritten for it as they compile (``graph/sequence.py``)."""
    from .runtime.sequence import SequenceGroup, requested_size
    size = requested_size(engine._config._param_dict)
    if size == 1:
        logger.warning("deepspeed-compile: compile.passes lists 'autosp' but sequence_parallel_size is 1 (its default): "
                       "nothing to split, every rank computes the whole sequence. Set sequence_parallel_size at the "
                       "top level of the ds_config")
        return
    if compile_config.regions == "blocks":
        logger.warning("deepspeed-compile: compile.regions='blocks' compiles each block on its own, and a block's "
                       "graph has no token ids to split: with sequence parallelism the blocks run on the whole "
                       "sequence on every rank. Leave regions at 'model' to split the sequence")
    runtime.sequence = SequenceGroup(size, runtime.comm)
    logger.info(f"deepspeed-compile: sequence parallelism over {size} ranks (ranks {runtime.sequence.ranks} share "
                "each batch)")


def _agree_on_recompile_limit(cause: str) -> None:
    """Dynamo reached its recompile limit at a frame (``cause`` says which limit): on this rank the frame runs
    uncompiled, dynamo's own fallback. In an engine's forward, where the ranks agree before each graph's first
    collective, this rank says so in place of the frame's graph: where every rank reached the limit here, all run the
    frame uncompiled and the step goes on; else every rank stops this step (``runtime/agreement.py``)."""
    from .runtime.agreement import LIMIT
    for state in list(_LIVE):
        runtime = state.runtime
        if runtime.agrees_at_recompile_limit and runtime.forward_running and runtime.engine.is_deepcompile_active() \
                and runtime.peers.agrees_now():
            outcome = runtime.peers.agree(LIMIT, cause)
            if not outcome.all(LIMIT):
                state.on_stopped(outcome)
            logger.warning(f"deepspeed-compile: every rank reached {cause}: they all run that frame uncompiled")


def _prepare_module_compile(engine, wrap_direct_calls: bool, drop_fullgraph: bool) -> None:
    """Adjust the ``engine.module.compile(...)`` the engine runs right after this returns: an instance attribute
    shadows that method once.

    ``wrap_direct_calls``: ``engine.module(...)`` called directly, not through the engine, runs in a forward context
    too. Hugging Face's Trainer evaluates by calling the module, and ``generate`` calls it once per token. At ZeRO-3
    the engine's forward installs the stand-ins dynamo traces the partitioned parameters with; a direct call skipped
    that, and dynamo traced ZeRO-3's empty ``.data`` (an embedding "must be 2-D" error). At ZeRO-1/2 the forward
    context opens the step whose backward hands the gradients to ZeRO; a direct call trained through
    ``engine.backward`` failed without it (a ``KeyError`` in the gradient bookkeeping). The compiled call is wrapped to
    enter :func:`direct_call_context`.

    ``drop_fullgraph`` (``regions: "blocks"``): the model's own frame breaks at every block by design, so
    ``fullgraph=True`` applies to the blocks' compiles (``regions.install``), not to the model's."""
    module = engine.module
    if not wrap_direct_calls and not drop_fullgraph:
        return

    def compile_adjusted(*args, **kwargs) -> None:
        ModuleCompile.unshadow_compile(module)
        if drop_fullgraph:
            kwargs.pop("fullgraph", None)
        module.compile(*args, **kwargs)
        if not wrap_direct_calls:
            return
        compiled_call = ModuleCompile.compiled_call(module)
        state = state_of(engine, active_only=False)
        if state is not None and state.runtime.sequence is not None:
            from .runtime.sequence import mark_dynamic_lengths
        else:
            mark_dynamic_lengths = None

        def call(*call_args, **call_kwargs):
            if mark_dynamic_lengths is not None:
                mark_dynamic_lengths(call_args, call_kwargs)
            with direct_call_context(engine):
                return compiled_call(*call_args, **call_kwargs)

        ModuleCompile.set_compiled_call(module, call)

    ModuleCompile.shadow_compile(module, compile_adjusted)


@contextmanager
def direct_call_context(engine) -> Iterator[None]:
    """A call of the compiled ``engine.module``: inside the engine's forward nothing more; called directly, the
    forward context the engine's forward would have entered (:func:`forward_context`)."""
    state = state_of(engine, active_only=False)
    if state is None or state.runtime.forward_running:
        yield None
        return
    with forward_context(engine):
        yield None


def activate_z3(engine, backend: str, compile_config: CompileConfig, schedule=None,
                compile_kwargs: Optional[Dict[str, Any]] = None) -> Optional[Callable]:
    """Give a ZeRO-3 engine its DeepCompile state and return the dynamo backend that compiles its graphs (None:
    fall back to plain ``torch.compile``)."""
    compat.check(3)  # a torch or DeepSpeed the package was not written for: refused before any change
    check_sequence_parallel(engine, compile_config)  # before any change
    if not _check_options(compile_config, backend, schedule, param_offload_device(engine)):
        return None
    if compile_config.tensor_parallel:
        fall_back("compile pass 'autotp' at ZeRO stage 3", "deepspeed-compile places AutoTP's collectives in ZeRO-1/2's "
                  "graphs; at ZeRO-3 AutoTP's layers run with their own collectives")
        return None
    inductor_config = _compile_kwargs_settings(backend, compile_kwargs)
    _check_regions(engine, compile_config)
    _warn_zeropp(engine)
    # imported here: these register the graph ops, which `import deepspeed` must not pay for
    from .driver import eager_hooks
    from .runtime.z3 import Z3Runtime
    runtime = Z3Runtime(engine, timeout_s=compile_config.collective_timeout_s, free_on_release=backend == "eager",
                        native_op=compile_config.native_op,
                        prefetch_across_graphs=compile_config.regions == "blocks",
                        host_comm=compile_config.host_comm, host_comm_dir=compile_config.host_comm_dir)
    eager_hooks.switch_off(engine)
    return _activate(engine, runtime, 3, backend, compile_config, inductor_config, compile_kwargs)


def activate_z12(engine, backend: str, compile_config: CompileConfig, schedule=None, stage: int = 1,
                 compile_kwargs: Optional[Dict[str, Any]] = None) -> Optional[Callable]:
    """Give a ZeRO-1 or ZeRO-2 engine its DeepCompile state (gradients handed to ZeRO's optimizer from inside the
    compiled backward, ``runtime/z12.py``) and return the dynamo backend that compiles its graphs."""
    compat.check(stage)  # a torch or DeepSpeed the package was not written for: refused before any change
    check_sequence_parallel(engine, compile_config)  # before any change
    if not _check_options(compile_config, backend, schedule):
        return None
    inductor_config = _compile_kwargs_settings(backend, compile_kwargs)
    _check_regions(engine, compile_config)
    tensor_layers = _tensor_parallel_layers(engine) if compile_config.tensor_parallel else []
    from .runtime.z12 import Z12Runtime
    runtime = Z12Runtime(engine, stage=stage, timeout_s=compile_config.collective_timeout_s,
                         host_comm=compile_config.host_comm, host_comm_dir=compile_config.host_comm_dir)
    if tensor_layers:
        from deepspeed.utils import groups
        from .runtime.tensor import tensor_group
        runtime.tensor = tensor_group(groups.get_tensor_model_parallel_group(), runtime.comm)
        runtime.tensor_layers = tensor_layers
        TensorParallelDeferral.defer(tensor_layers)
    return _activate(engine, runtime, stage, backend, compile_config, inductor_config, compile_kwargs)


def activate_z0(engine, backend: str, compile_config: CompileConfig, schedule=None,
                compile_kwargs: Optional[Dict[str, Any]] = None) -> Optional[Callable]:
    """Give a ZeRO-0 engine with ``"passes": ["autosp"]`` its DeepCompile state (``runtime/z0.py``: nothing sharded,
    the engine all-reduces the gradients) and return the dynamo backend that splits each sequence in its graphs."""
    compat.check(0)  # a torch or DeepSpeed the package was not written for: refused before any change
    check_sequence_parallel(engine, compile_config)  # before any change
    if not _check_options(compile_config, backend, schedule):
        return None
    inductor_config = _compile_kwargs_settings(backend, compile_kwargs)
    _check_regions(engine, compile_config)
    from .runtime.z0 import Z0Runtime
    runtime = Z0Runtime(engine, timeout_s=compile_config.collective_timeout_s)
    return _activate(engine, runtime, 0, backend, compile_config, inductor_config, compile_kwargs)


def _tensor_parallel_layers(engine) -> list:
    """``"passes": ["autotp"]``: the AutoTP layers whose collectives the graphs take over (``graph/tensor.py``), or a
    ValueError naming one they cannot, before anything changes; none (and a warning) where AutoTP shards nothing."""
    from .graph.tensor import layer_kinds
    if engine.autotp_size() <= 1:
        logger.warning("deepspeed-compile: compile.passes lists 'autotp' but tensor_parallel.autotp_size is "
                       f"{engine.autotp_size()}: AutoTP shards nothing, so there is nothing to place")
        return []
    return [engine.module.get_submodule(name) for name in layer_kinds(engine.module)]


def deactivate(engine, uncompile: bool = False) -> None:
    """Return ``engine`` to eager ZeRO: the runtime detached (ZeRO-3: stand-ins out, eager hooks back on;
    ZeRO-1/2: ZeRO's gradient hooks back), DeepCompile marked inactive. With ``uncompile`` the module's
    ``torch.compile`` wrapper is dropped too: after a failed compile the eager ZeRO hooks must run as plain Python,
    not be re-traced by dynamo."""
    state = state_of(engine, active_only=False)
    if state is not None:
        state.runtime.detach()
    from .driver import eager_hooks
    eager_hooks.switch_on(engine)  # ZeRO-3's module hooks back, where activating switched them off
    if engine.is_deepcompile_active():
        engine._set_deepcompile_active(False)
    if uncompile:
        from .driver import regions
        regions.uninstall(engine.module)
        # nn.Module.compile() keeps its wrapper here; the engine records compilation in _is_compiled
        ModuleCompile.set_compiled_call(engine.module, None)
        engine._is_compiled = False


def _adopts_regional_compile(engine) -> bool:
    """Whether Accelerate compiled the engine's blocks in place and DeepCompile now compiles the engine instead
    (``integrations/accelerate.py``, imported here: not at ``import deepspeed``)."""
    from .integrations import accelerate
    return accelerate.adopt_regional_compile(engine)


@contextmanager
def forward_context(engine) -> Iterator[None]:
    """One forward of ``engine``: prepared by its runtime when DeepCompile is active (stand-ins in, eager access
    on); if the engine left DeepCompile since its last forward, it is returned to eager ZeRO-3 first."""
    state = state_of(engine, active_only=False)
    if state is None and _adopts_regional_compile(engine):
        state = state_of(engine, active_only=False)
    if state is None:
        _warn_sequence_not_split(engine)
        yield None
        return
    if not engine.is_deepcompile_active():
        deactivate(engine)
        yield None
        return
    from .driver import eager_hooks
    eager_hooks.drop_reregistered(engine)  # ZeRO-3's module hooks, where something registered them again
    with state.runtime.forward_context(), ds_checkpointing.deepcompile_forward():
        yield None


_SEQUENCE_WARNED = "_deepspeed_compile_sequence_warned"


def _warn_sequence_not_split(engine) -> None:
    """``"autosp"`` asked for, and the engine compiled without DeepCompile (``deepcompile`` false, a fallback): say
    once that every rank computes the whole sequence."""
    if not engine.is_compiled or getattr(engine, _SEQUENCE_WARNED, False):
        return
    if getattr(engine._config.compile_config, "sequence_parallel", False):
        setattr(engine, _SEQUENCE_WARNED, True)
        logger.warning("deepspeed-compile: compile.passes lists 'autosp', but this engine runs without DeepCompile "
                       f"(ZeRO stage {engine.zero_optimization_stage()}, compile.deepcompile "
                       f"{engine.is_deepcompile_enabled()}): sequence parallelism runs with DeepCompile, so here "
                       "every rank computes the whole sequence")


class PassTimes(Mapping):
    """Seconds spent in each pipeline pass, summed over the live engines of this process: the process-wide view
    ``engine.get_compile_time()`` returns. Each engine keeps its own times (``CompileStats.pass_times``); this
    view only reads them."""

    def _totals(self) -> dict:
        totals: dict = {}
        for state in list(_LIVE):
            for name, seconds in state.stats.pass_times.items():
                totals[name] = totals.get(name, 0.0) + seconds
        return totals

    def __getitem__(self, name: str) -> float:
        return self._totals()[name]

    def __iter__(self):
        return iter(self._totals())

    def __len__(self) -> int:
        return len(self._totals())

    def __repr__(self) -> str:
        return repr(self._totals())

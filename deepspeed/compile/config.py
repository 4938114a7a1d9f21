# SPDX-License-Identifier: Apache-2.0
"""The ``"compile"`` section of a ds_config.

DeepSpeed's engine reads several stock fields directly (``deepcompile``, ``autoep_non_moe``, ``passes``,
``offload_parameters`` ...), so every stock field is kept with its stock meaning; the ones this module does not
implement are reported by :func:`unimplemented_options` and handled at ``engine.compile()``. Unknown keys are
rejected by ``DeepSpeedConfigModel`` (pydantic, ``extra="forbid"``) at ``deepspeed.initialize``.
"""
from typing import List, Literal, Optional, Union

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, PrivateAttr, model_validator
from typing_extensions import Annotated

PassName = Literal["z1", "z3", "autosp", "autotp"]
Partitioner = Literal["min_cut", "default"]


class CompileConfig(DeepSpeedConfigModel):
    """Settings for ``engine.compile()``; ``deepcompile`` selects this module's pipeline for the engine's ZeRO stage."""

    # --- stock fields (DeepSpeed's engine reads several; their names and defaults are the engine's contract) ----
    deepcompile: bool = Field(False, description="with engine.compile(): run this module's compiled pipeline for the "
                              "engine's ZeRO stage (3, or 1 and 2; 0 with 'autosp' only)")
    autoep_non_moe: bool = Field(False, description="stock AutoEP region compile, handled by the engine itself")
    passes: Optional[List[PassName]] = Field(None, description="stock pass composition; None, ['z1'] or ['z3'] run "
                                             "the pipeline of the engine's ZeRO stage, 'autosp' adds sequence "
                                             "parallelism to it, 'autotp' places AutoTP's collectives in ZeRO-1/2's "
                                             "graphs (ZeRO-3: plain torch.compile); both taken out of the list at "
                                             "stages 1-3, see sequence_parallel and tensor_parallel")
    offload_parameters: bool = Field(False, description="ZeRO-3 with offload_param to cpu: runs (the engine sets it); "
                                     "otherwise not implemented, falls back")
    offload_opt_states: bool = Field(False, description="stock offload: not implemented, falls back")
    offload_activation: bool = Field(False, description="stock offload: not implemented, falls back")
    offload_activation_pin_memory: bool = Field(True, description="stock offload setting: no effect here")
    free_activation: bool = Field(False, description="stock knob: no effect here")
    free_activation_threshold: int = Field(10 * 1024 * 1024, description="stock knob: no effect here")
    double_buffer: bool = Field(True, description="stock knob: no effect here")
    symmetric_memory: bool = Field(False, description="stock knob: no effect here")
    debug_log: bool = Field(False, description="stock knob: no effect here")
    sync_before_reduce: bool = Field(False, description="stock knob: no effect here")
    sync_after_reduce: bool = Field(False, description="stock knob: no effect here")
    sync_before_allgather: bool = Field(False, description="stock knob: no effect here")
    sync_after_allgather: bool = Field(False, description="stock knob: no effect here")
    keep_int_input_tensors: bool = Field(True, description="stock knob: no effect here")
    keep_all_input_tensors: bool = Field(False, description="stock knob: no effect here")

    # --- deepspeed-compile fields ---------------------------------------------------------------------------
    partitioner: Partitioner = "min_cut"
    """``"min_cut"``: min-cut rematerialization with gathered parameters, their aliases and downcasts recomputed
    in backward (the design of this module). ``"default"``: AOTAutograd's default partition, for comparison."""
    fused_cast: bool = True
    """Fold a downcast of a gathered parameter into its all-gather: the shard is cast before it is sent."""
    fused_matmul_reduce: bool = True
    """ZeRO-1/2: a reduce whose gradient is a matmul's result (a linear layer's weight gradient) computes the
    product itself, into ZeRO-2's reduce bucket where it goes at once, instead of copying the graph's result there.
    False: the graph computes it and the reduce copies it, for comparison."""
    schedule: Literal["fast_free", "traced"] = "fast_free"
    """``"fast_free"``: reorder each graph so gathered parameters are released as early as possible and gathered
    just in time (``docs/schedule.md``). ``"traced"``: keep the traced order (gathers at the top), for comparison."""
    prefetch: int = Field(default=1, ge=0)
    """With ``"fast_free"``: how many gathers may be issued ahead of the one the next op needs."""
    native_op: Literal["auto", "native", "python"] = "auto"
    """The fused cast + all-gather: ``"native"`` (the C++ op, JIT-built at first use; an error if it cannot be
    built), ``"python"`` (torch.distributed calls), ``"auto"`` (native if it builds, else Python with one
    warning saying why)."""
    keep_gathered_bytes: Union[Literal["reuse_distance", "prefetch"], Annotated[int, Field(ge=0)]] = "reuse_distance"
    """With ``"min_cut"``: which gathered parameters stay gathered from forward to backward instead of being gathered
    again there. ``"reuse_distance"`` (the default): those eager ZeRO-3 would keep, by DeepSpeed's
    ``stage3_max_reuse_distance`` (elements): a parameter stays gathered when fewer elements of other parameters are
    used between its last use in forward and its first in backward (``graph/recompute.reuse_distances``). DeepSpeed's
    default (1e9) keeps every parameter, as eager ZeRO-3 does; 0 keeps none. A number: up to this many bytes (per
    engine, summed over its graphs), the last gathered in forward first (backward needs them first, so they are
    held the shortest time). ``"prefetch"``: one prefetch bucket (``stage3_prefetch_bucket_size`` elements of the
    parameters' dtype), about what backward's first run of gathers would gather again at once. 0: every parameter
    is gathered again in backward, whatever ``stage3_max_reuse_distance`` says."""
    regions: Literal["model", "blocks"] = "model"
    """``"model"``: the whole model is captured as one forward and one backward graph (per graph break), so the
    schedule prefetches across its blocks. ``"blocks"``: each repeated block (the members of an ``nn.ModuleList`` of
    two or more modules of one class: a transformer's layers) is compiled as a graph of its own, and the graph
    compiled for the first block serves every block: the backend compiles one block instead of the whole model, so
    the first step stays flat with depth, and each step enters every block's graph from Python; gathers are
    prefetched across block boundaries from the second step on (``driver/regions.py``)."""
    eager_graph_code: Literal["direct", "fx"] = "direct"
    """With ``backend="eager"``: the code a final graph runs as. ``"direct"``: FX's generated code made a generator
    (its frame on the heap, not CPython's data stack) calling each ATen op through the C++ function behind its
    ``OpOverload`` (``driver/eager_code.py``). ``"fx"``: FX's generated code as it is, for comparison or where the
    rewrite is in doubt. Bitwise the same results."""
    aot_cache: bool = True
    """With ``backend="inductor"``: let torch's AOTAutograd cache (``torch._functorch.config.enable_autograd_cache``,
    on by default, in ``TORCHINDUCTOR_CACHE_DIR``) serve compiled graphs to a later process, keyed on this module's
    source and settings; a warm start then skips AOTAutograd, our passes and inductor's lowering. False: compile
    every graph afresh (inductor's FX-graph cache still applies)."""
    host_comm: Literal["auto", "shm", "gloo"] = "auto"
    """On CPU: how ZeRO-3's all-gathers and gradient reductions and ZeRO-2's bucket all-reduces move between ranks.
    ``"auto"`` (the default): through shared memory where every rank of the group is on this host (gloo's sockets copy
    the bytes on the cores that compute), else through the process group. ``"shm"``: shared memory, or an error at
    set-up saying why not. ``"gloo"``: always the process group (``docs/design.md``, "Collectives through shared
    memory")."""
    agree_on_failures: bool = True
    """On gloo, at any ZeRO stage: before each compiled graph's first collective (ZeRO-1/2: before its backward's
    first gradient is accumulated) the ranks agree, in a small all-reduce, that each runs its graph, so that one
    rank's compile failure or recompile limit stops every rank in the same step with an error naming the rank and the
    cause, on either transport, and all go on as eager ZeRO (``runtime/agreement.py``). False: a compile failure is
    posted through shared memory only, and through the process group, or for a recompile limit, the ranks may go on
    different paths."""
    host_comm_dir: str = "/dev/shm"
    """Where ``host_comm`` creates its segments (one file a rank, unlinked once every rank has mapped every segment):
    a directory on a memory-backed file system (tmpfs) that every rank of the host sees as the same directory. Where
    it has too little free space, is not writable, or is not shared between the ranks, ``"auto"`` goes through the
    process group with one warning saying why, and ``"shm"`` fails at set-up."""
    collective_timeout_s: float = Field(default=0.0, ge=0.0)
    """If > 0, a gather or reduce that has not completed after this many seconds raises instead of hanging; 0: the
    process group's own timeout (``deepspeed.init_distributed(timeout=...)``, 30 minutes by default). Through shared
    memory a peer whose process is gone, or that stopped with an error, ends the wait within a second either way."""

    release_host_memory: Union[bool, Literal["auto"]] = "auto"
    """At the end of each backward that ends a gradient-accumulation cycle, before the optimizer step: hand the memory
    the C library's allocator holds free (the step's gathered parameters and activations, freed in backward) back to
    the OS (glibc's ``malloc_trim``), so that the optimizer step's temporaries take its place instead of adding to the
    process's resident memory (``runtime/host_memory.py``). ``"auto"`` (the default): where the parameters live on the
    CPU. True: wherever they live (the host memory of CPU offload). False: never. True where the C library has no
    ``malloc_trim`` (not glibc) is refused at ``engine.compile()``; ``"auto"`` is then off."""

    _sequence_parallel: bool = PrivateAttr(False)
    _tensor_parallel: bool = PrivateAttr(False)

    @model_validator(mode="after")
    def _take_parallel_passes(self) -> "CompileConfig":
        """``"autosp"`` in ``passes`` asks for sequence parallelism (``graph/sequence.py``), ``"autotp"`` for AutoTP's
        collectives in the graphs (``graph/tensor.py``); both run inside this module's ZeRO pipelines. DeepSpeed's
        engine sends a config that lists either to a backend of its own instead, which refuses AutoSP at ZeRO-2 and 3
        and AutoTP with any ZeRO pass; taken out of the list here, ZeRO stages 1-3 reach this module's pipelines.
        At ZeRO-0 "autosp" stays, and the engine's AutoSP entry point reaches this module (``init_sp``)."""
        if self.passes and ("autosp" in self.passes or "autotp" in self.passes):
            # (the assignment below validates the section again, with the names it keeps)
            self._sequence_parallel = self._sequence_parallel or "autosp" in self.passes
            self._tensor_parallel = self._tensor_parallel or "autotp" in self.passes
            # at ZeRO-0 the engine compiles without its ZeRO passes, and reaches this module for sequence
            # parallelism only through its AutoSP entry point (``init_sp``): "autosp" stays listed there
            taken = ("autotp", ) if _zero_stage_being_read() == 0 else ("autosp", "autotp")
            if any(name in taken for name in self.passes):
                self.passes = [name for name in self.passes if name not in taken]
        return self

    @property
    def sequence_parallel(self) -> bool:
        """Whether ``passes`` listed ``"autosp"``: shard each sequence over ``sequence_parallel_size`` ranks."""
        return self._sequence_parallel

    @property
    def tensor_parallel(self) -> bool:
        """Whether ``passes`` listed ``"autotp"``: AutoTP's collectives placed in the graphs."""
        return self._tensor_parallel


# Stock options this module does not implement, with what happens when they are set.
_FALLBACK_OPTIONS = ("offload_parameters", "offload_opt_states", "offload_activation")
_IGNORED_OPTIONS = ("free_activation", "symmetric_memory", "sync_before_reduce", "sync_after_reduce",
                    "sync_before_allgather", "sync_after_allgather", "keep_all_input_tensors")


def unimplemented_options(config: CompileConfig, param_offload: str = "none") -> "tuple[list[str], list[str]]":
    """Names of set options that force a fallback to plain torch.compile, and names that have no effect here.
    ``param_offload`` is where ZeRO-3 keeps the parameter shards (``offload_param.device``): the engine sets
    ``offload_parameters`` when they live on the CPU, and ZeRO-3's pipeline runs with them there."""
    fallback = [name for name in _FALLBACK_OPTIONS
                if getattr(config, name) and not (name == "offload_parameters" and param_offload == "cpu")]
    ignored = [name for name in _IGNORED_OPTIONS if getattr(config, name)]
    return fallback, ignored


def _zero_stage_being_read() -> Optional[int]:
    """The ZeRO stage of the ds_config DeepSpeed is reading while it builds this section (``DeepSpeedConfig`` reads
    ``zero_optimization`` first, ``compat.TARGETS``), or None where the section is built on its own."""
    from . import compat  # not at import: stock DeepSpeed imports this module while it is imported itself
    names = compat.caller_locals("_initialize_params", 16)  # pydantic's validation frames come between
    owner = None if names is None else names.get("self")
    stage = getattr(owner, "zero_optimization_stage", None) if type(owner).__name__ == "DeepSpeedConfig" else None
    return None if stage is None else int(stage)

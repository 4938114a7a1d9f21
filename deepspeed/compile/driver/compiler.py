# SPDX-License-Identifier: Apache-2.0
"""The dynamo backend of a compiled ZeRO-3 engine: AOTAutograd with our partition function and compilers.

Per dynamo graph (one per graph break) a :class:`GraphCompiler` runs, in order:
  insert gathers (dynamo graph) -> AOTAutograd joint trace -> tag parameter aliases/downcasts
  -> partition (min-cut by default)
  -> forward: fold downcasts, insert releases, fast-free schedule, pin gathers, coalesce gathers
  -> backward: insert reduces, then the forward's passes in the same order
  -> the backend's own compiler (eager or inductor).
The compiler owns what compiling tells about the graphs (:class:`CompileStats`, one per engine); the runtime it
compiles for owns communication and buffers only.
"""
import copy
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from deepspeed.utils import logger
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import RestartAnalysis
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.fx import GraphModule

from ..config import CompileConfig
from ..graph import rewrite
from . import cache
from .eager_code import boxed_eager
from .stages import graphs_of
from ..graph.nodes import META_DS_ID, is_gather, is_reduce, joint_primals
from ..runtime.ops import PLAIN_CALLS, UNTRACED_CALLS
from ..graph.in_place import in_place_sums_pass, owned_reduces_pass
from ..graph.masks import causal_masks_pass, run_time_causal_pass
from ..graph.recompute import tag_param_aliases_pass
from ..graph.runner import run_passes
from ..graph.saved import SavedBytes, saved_for_backward
from ..graph.sequence import shard_sequence
from ..graph.tensor import overlap_tensor_sums, place_tensor_collectives
from ..schedule.fast_free import fast_free_schedule
from ..schedule.memory_plan import peak_gathered_bytes

log = logging.getLogger(__name__)


@dataclass(eq=False)
class CompileStats:
    """What compiling an engine's graphs found, summed over its graphs (``report.engine_report`` reads it). A graph
    loaded from torch's AOTAutograd cache adds what compiling it found, from its record (``driver/cache.py``)."""
    saved: SavedBytes = field(default_factory=SavedBytes)  # saved-for-backward bytes of the forward graphs
    graphs_compiled: int = 0  # forward graphs, compiled here or loaded
    graphs_loaded: int = 0  # of those, loaded from torch's AOTAutograd cache: our compilers did not run for them
    # forward graphs by the backend that compiled them (regions="blocks" under inductor: the blocks' inductor's, the
    # graphs outside them the eager backend's)
    graphs_by_backend: Dict[str, int] = field(default_factory=dict)
    # per compiled graph, in compile order: the (op, ds_id) sequence of its collectives (same on every rank)
    collective_orders: List[List[Tuple[str, int]]] = field(default_factory=list)
    pass_times: Dict[str, float] = field(default_factory=dict)  # seconds per pipeline pass
    # the largest static-plan peak of live gathered bytes over the graphs, in-flight collectives included: the
    # runtime's measured peak stays at or below it (up to shard padding) while no code outside the graphs gathers
    # and no run is prefetched across graphs (compile.regions='blocks': one run more, at a block boundary)
    planned_peak_gathered_bytes: int = 0
    # seconds in the forward / backward graph compilers (our passes and the backend's compile), per direction, and
    # in the partition of the joint graphs (our tagging and torch's partitioner)
    compile_seconds: Dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0,
                                                                       "partition": 0.0})
    kept_gathered_bytes: int = 0  # of compile.keep_gathered_bytes, taken by parameters kept gathered for backward
    sequence_collectives: int = 0  # collectives of the sequence group placed in the forward graphs (autosp)
    sequence_whole_ops: Dict[str, int] = field(default_factory=dict)  # of those graphs' ops, those run unsplit, by op
    tensor_parallel_layers: int = 0  # AutoTP layers whose collectives the forward graphs place (autotp)
    tensor_sums_overlapped: int = 0  # of AutoTP's sums in the backward graphs, those left in flight over other code
    causal_masks: int = 0  # attentions given is_causal for a constant causal mask (graph/masks.py)
    run_time_masks: int = 0  # attentions whose mask is found causal or not at run time (graph/masks.py)
    sums_in_place: int = 0  # eager backend: sums written into an operand that dies there (graph/in_place.py)

    def add(self, part: Dict) -> None:
        """Add what compiling one direction of one graph found (:meth:`GraphCompiler._account`)."""
        self.collective_orders.append([tuple(item) for item in part["order"]])
        self.planned_peak_gathered_bytes = max(self.planned_peak_gathered_bytes, part["planned_peak"])
        if "saved" in part:
            saved = part["saved"]
            self.saved += SavedBytes(**saved) if isinstance(saved, dict) else saved
        graphs = part.get("graphs", 0)
        self.graphs_compiled += graphs
        if graphs:
            backend = part.get("backend", "inductor")  # a record written before the key was: only inductor caches
            self.graphs_by_backend[backend] = self.graphs_by_backend.get(backend, 0) + graphs
        self.kept_gathered_bytes += part.get("kept", 0)


class GraphCompiler:
    """Compiles one dynamo graph; holds what its forward, partition and backward steps tell each other."""

    def __init__(self, runtime, stats: CompileStats, config: CompileConfig, backend: str,
                 param_ds_ids: List[Optional[int]], on_failure: Optional[Callable[[BaseException, bool], None]] = None,
                 grad_ds_ids: Optional[List[Optional[int]]] = None, inductor_config: Optional[Dict[str, Any]] = None):
        self.runtime = runtime
        self.stage_graphs = graphs_of(runtime)  # what this stage does differently (driver/stages.py)
        self.inductor_config = inductor_config or {}  # compile_kwargs' mode and options, resolved
        self.stats = stats
        self.on_failure = on_failure
        self.config = config
        self.backend = backend
        self.param_ds_ids = param_ds_ids  # per graph input (= per joint primal): ds_id of a gathered one, or None
        # per graph input: the ds_id of the parameter whose gradient the backward reduces, or None
        self.grad_ds_ids = param_ds_ids if grad_ds_ids is None else grad_ds_ids
        self.num_fwd_outputs: Optional[int] = None
        self.escaped: Dict[str, int] = {}
        self.kept = 0  # bytes of parameters this graph keeps gathered for backward
        self.compiled = False  # set by the forward compiler: False after AOTAutograd means torch loaded the graph
        self.record: Optional[str] = None  # name of this graph's compile record (driver/cache.py), when caching
        self.split = False  # the graph splits its sequence over the sequence group (its runs pair across ranks)

    # --- partition ---------------------------------------------------------------------------------------
    def partition(self, joint: GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        """AOTAutograd's partition step. Under inductor it runs as inductor's custom partitioner
        (``driver/cache.Partitioner``), after inductor's own joint-graph passes (pattern rewrites, no-op removal)
        as plain torch.compile runs them: without them the partition saves more for backward than torch.compile's."""
        kwargs.pop("compiler", None)  # inductor names itself; both partitions below compile for any backend
        start = time.perf_counter()
        try:
            return self._partition(joint, joint_inputs, num_fwd_outputs, kwargs)
        finally:
            self.stats.compile_seconds["partition"] += time.perf_counter() - start

    def _partition(self, joint: GraphModule, joint_inputs, num_fwd_outputs: int, kwargs):
        primals = joint_primals(joint.graph)
        if len(primals) != len(self.param_ds_ids):
            raise AssertionError(f"joint graph has {len(primals)} primals for {len(self.param_ds_ids)} inputs")
        for node, ds_id in zip(primals, self.param_ds_ids):
            if ds_id is not None:
                node.meta[META_DS_ID] = ds_id
        self.num_fwd_outputs = num_fwd_outputs
        self.stage_graphs.prepare_joint(joint, num_fwd_outputs, self.grad_ds_ids)
        if self.config.partitioner == "min_cut":
            kept = self.stage_graphs.kept(self, joint)
            self.kept = sum(kept.values())
            tag_param_aliases_pass(joint, keep=frozenset(kept))
            return min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                                       **kwargs)
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    # --- forward / backward ------------------------------------------------------------------------------
    def _common_passes(self):
        rid = self.runtime.id
        passes = []
        if self.config.fused_cast:
            passes.append(("fold_downcasts", rewrite.fold_downcasts_pass))
        passes.append(("insert_releases", functools.partial(rewrite.insert_releases_pass, runtime_id=rid)))
        if self.config.schedule == "fast_free":
            # first-use collective order: a function of the graph alone, so identical on every rank
            passes.append(("fast_free_schedule", functools.partial(fast_free_schedule, prefetch=self.config.prefetch,
                                                                   collective_order="first_use")))
        if self.runtime.gather_bucket_numel > 0:
            passes.append(("coalesce_gathers", functools.partial(rewrite.coalesce_gathers_pass,
                                                                 bucket_numel=self.runtime.gather_bucket_numel)))
        passes.append(("pin_gathers", rewrite.pin_gathers_pass))
        return passes

    def compile_forward(self, gm: GraphModule, example_inputs):
        start = time.perf_counter()
        try:
            return self._compile_forward(gm, example_inputs)
        finally:
            self.stats.compile_seconds["forward"] += time.perf_counter() - start

    def _compile_forward(self, gm: GraphModule, example_inputs):
        self.compiled = True
        gm = run_passes(gm, self._common_passes(), self.stats.pass_times)
        self.escaped = rewrite.escaped_saved_names(gm)
        inference = self.num_fwd_outputs is None  # no partition ran: nothing is saved for backward
        saved = {} if inference else {"saved": saved_for_backward(gm, self.num_fwd_outputs)}
        self._account("forward", gm, graphs=1, backend=self.backend, kept=self.kept, **saved)
        return self._finish(gm, example_inputs, is_backward=False, is_inference=inference)

    def compile_backward(self, gm: GraphModule, example_inputs):
        """AOTAutograd compiles backward lazily, inside the first ``backward()``: past the backend's own fallback.
        A failure here returns the engine to eager ZeRO-3 for the next steps and says that this step's backward
        is lost."""
        start = time.perf_counter()
        try:
            return self._compile_backward(gm, example_inputs)
        except Exception as err:
            if self.on_failure is not None:
                # the peers' backward, where it gathers or reduces, agrees before its first collective
                gathered = [ds_id for ds_id in self.param_ds_ids if ds_id is not None]
                self.on_failure(err, pairs_across_ranks(gathered, self.grad_ds_ids, True, self.split))
            raise RuntimeError(f"deepspeed-compile: compiling a backward graph failed ({type(err).__name__}: {err}). "
                               "This step's backward cannot run: skip it (do not call engine.step()); the engine "
                               "runs uncompiled eager ZeRO-3 from the next forward on") from err
        finally:
            self.stats.compile_seconds["backward"] += time.perf_counter() - start

    def _compile_backward(self, gm: GraphModule, example_inputs):
        rewrite.mark_escaped_inputs(gm, self.escaped)
        rid = self.runtime.id
        passes = [("insert_reduces", functools.partial(rewrite.insert_reduces_pass, runtime_id=rid,
                                                       grad_ds_ids=self.grad_ds_ids))]
        passes += self._common_passes()
        if self.runtime.tensor is not None:  # AutoTP's sums in flight while the weight gradients are computed
            passes.append(("overlap_tensor_sums", self._overlap_tensor_sums))
        gm = run_passes(gm, passes, self.stats.pass_times)
        self._account("backward", gm)
        return self._finish(gm, example_inputs, is_backward=True, is_inference=False)

    def _overlap_tensor_sums(self, gm: GraphModule) -> GraphModule:
        self.stats.tensor_sums_overlapped += overlap_tensor_sums(gm, self.runtime.id)
        return gm

    def _in_place_sums(self, gm: GraphModule) -> GraphModule:
        self.stats.sums_in_place += in_place_sums_pass(gm)
        return gm

    def _owned_reduces(self, gm: GraphModule) -> GraphModule:
        owned_reduces_pass(gm)  # what it let the runtime do is counted there (grads_reduced_in_place)
        return gm

    def _account(self, direction: str, gm: GraphModule, **found) -> None:
        """Add what compiling one direction of this graph found to the engine's stats, and to its compile record
        when torch may cache the graph (a process that loads it adds the record instead, :meth:`load_record`)."""
        part = {"order": collective_order(gm), "planned_peak": peak_gathered_bytes(gm), **found}
        self.stats.add(part)
        if self.record is not None:
            cache.write_record(self.record, direction, cache.as_plain(part))

    def load_record(self) -> None:
        """torch loaded this graph from its AOTAutograd cache: add what compiling it found, from its record."""
        self.stats.graphs_loaded += 1
        parts = [cache.read_record(self.record, direction) for direction in ("forward", "backward")]
        if parts[0] is None:
            log.warning("deepspeed-compile: a graph was loaded from torch's AOTAutograd cache without its compile "
                        "record (%s): engine_report's saved bytes, planned peak and collective order leave it out",
                        cache.record_dir())
            return
        for part in parts:
            if part is not None:  # no backward part: an inference graph, or a process that never ran backward
                self.stats.add(part)

    def _lowering(self, is_backward: bool) -> List[Tuple[str, Callable[[GraphModule], GraphModule]]]:
        """The passes that make a graph, once our passes have placed its collectives, into what the backend runs,
        in order. Eager: a ZeRO-1/2 backward's weight gradients fused with their reduces, sums written into an operand
        that dies there, reduces told where nothing else reads their gradient, then each op called as the plain
        function behind it. Inductor: reduces deferred past fusible code, the fusion, the collectives' order made a
        data dependency (inductor may not reorder them), then each op called as its untraced twin."""
        fused = self.stage_graphs.lowering(is_backward, self.config)
        if self.backend == "eager":
            # nothing traces or differentiates the graph any more: sums may reuse a dying operand and reduces their
            # gradient (inductor reuses buffers itself), and the dispatcher's custom-op path would be overhead
            return fused + [("in_place_sums", self._in_place_sums), ("owned_reduces", self._owned_reduces),
                            ("plain_calls", functools.partial(rewrite.retarget_calls_pass, targets=PLAIN_CALLS))]
        # a reduce where its gradient is produced would split fused kernels; inductor's reordering depends on shapes;
        # our ops without the layers tracing needed are called past them from here on
        return [("defer_reduces", rewrite.defer_reduces_pass), *fused,
                ("chain_collectives", rewrite.chain_collectives_pass),
                ("untraced_calls", functools.partial(rewrite.retarget_calls_pass, targets=UNTRACED_CALLS))]

    def _finish(self, gm: GraphModule, example_inputs, *, is_backward: bool, is_inference: bool):
        # A reduce's parameter input is a handle: the runtime finds the parameter from its storage (``param_of``). A
        # parameter also read by eager code in the step (a tied weight a Python frame uses) holds its gathered data
        # from that read until backward ends, so the handle arrives with the gathered tensor's strides, not the
        # stand-in's it was traced with; inductor's input asserts would reject it. Nothing in the graph reads it.
        handles = is_backward and any(is_reduce(n) and n.args[3] is not None for n in gm.graph.nodes)
        gm = run_passes(gm, self._lowering(is_backward), self.stats.pass_times)
        if self.backend == "eager":
            return boxed_eager(gm, self.config.eager_graph_code)
        from torch._inductor.compile_fx import compile_fx_inner
        # the user's inductor settings again: AOTAutograd compiles the backward at its first run, after compile_graph.
        # Never inductor's layout optimization: with a convolution in the graph it gives a 2-D convolution's weight (a
        # gathered parameter, or a ZeRO-1/2 parameter handed to a reduce) a channels-last copy that stands in for it
        # at every use, and our ops find a parameter by its storage (docs/inductor.md, fix 6)
        patches = {**self.inductor_config, "layout_optimization": False,
                   **({"size_asserts": False} if handles else {})}
        with torch._inductor.config.patch(patches):
            return compile_fx_inner(gm, example_inputs, is_backward=is_backward, is_inference=is_inference)


def collective_order(gm: GraphModule) -> List[Tuple[str, int]]:
    """The gathers and reduces of a graph, in order, by parameter: every rank must issue the same sequence."""
    return [("gather" if is_gather(n) else "reduce", n.args[2]) for n in gm.graph.nodes if is_gather(n) or is_reduce(n)]


def _aot_compile(compiler: GraphCompiler, gm: GraphModule, example_inputs) -> Callable:
    """AOTAutograd with our partition and compilers. Under inductor the partition is inductor's custom partitioner,
    keyed on our source and settings, so torch's AOTAutograd cache may serve the graph (``compile.aot_cache``):
    then our compilers do not run and the graph's compile record stands in for them (``driver/cache.py``)."""
    if compiler.backend == "eager":
        aot = aot_autograd(fw_compiler=compiler.compile_forward, bw_compiler=compiler.compile_backward,
                           partition_fn=compiler.partition, keep_inference_input_mutations=True)
        # the eager backend's compiled graphs are Python functions: nothing torch could cache
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return aot(gm, example_inputs)
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
    from torch._inductor.compile_fx import partition_fn as inductor_partition
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V
    from torch._inductor.output_code import OutputCode
    runtime, stats = compiler.runtime, compiler.stats
    settings = compiler.config.model_dump(exclude={"aot_cache"})  # whether to cache does not change the graphs
    sequence = runtime.sequence
    key = cache.compile_key(config=settings, stage=runtime.stage,
                            sequence=None if sequence is None else (sequence.size, sequence.rank),
                            tensor=None if runtime.tensor is None else runtime.tensor.size,
                            world=torch.distributed.get_world_size(),
                            runtime_id=runtime.id, gather_bucket_numel=runtime.gather_bucket_numel,
                            keep=compiler.stage_graphs.keep_key(compiler), kept_before=stats.kept_gathered_bytes,
                            ds_ids=compiler.param_ds_ids, grad_ds_ids=compiler.grad_ds_ids)
    fw, bw = compiler.compile_forward, compiler.compile_backward
    use_cache = compiler.config.aot_cache
    if use_cache:
        compiler.record = cache.record_key(key, gm, example_inputs)
        fw, bw = SerializableAOTDispatchCompiler(OutputCode, fw), SerializableAOTDispatchCompiler(OutputCode, bw)
    aot = aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=inductor_partition,
                       decompositions=select_decomp_table(), keep_inference_input_mutations=True)
    # inductor's joint-graph passes read the fake mode from its virtualized context, which compile_fx sets around
    # AOTAutograd: without it a graph with random ops (dropout) failed in replace_random's seed pass ("'NullHandler'
    # object does not support the context manager protocol")
    fake_mode = detect_fake_mode(example_inputs) or torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)
    with torch._inductor.config.patch(custom_partitioner_fn=cache.Partitioner(compiler.partition, key)), \
            torch._functorch.config.patch(enable_autograd_cache=use_cache and
                                          torch._functorch.config.enable_autograd_cache), \
            V.set_fake_mode(fake_mode):
        compiled = aot(gm, example_inputs)
    if use_cache and not compiler.compiled:
        compiler.load_record()
    return compiled


def make_backend(runtime, stats: CompileStats, config: CompileConfig, backend: str,
                 on_failure: Callable[[BaseException, bool], None], inductor_config: Optional[Dict[str, Any]] = None):
    """The callable handed to ``torch.compile``: compiles each dynamo graph of the engine's module. Under inductor,
    every graph compiles with ``inductor_config`` (``engine_state.inductor_settings``) patched into inductor's
    config. ``on_failure(err, in_place_of_a_graph)`` is told of a failed compile. Where the runtime's ranks agree
    before each graph's first collective (``runtime/agreement.py``), a graph that gathers is marked so."""
    inductor_config = inductor_config or {}

    def compile_graph(gm: GraphModule, example_inputs, mode=None, options=None):
        # ``mode`` and ``options``: torch.compile hands a callable backend those of compile_kwargs; the engine
        # resolved them already (``inductor_config``), and graphs of ``regions: "blocks"`` get none from torch
        if not runtime.engine.is_deepcompile_active():
            # the engine went back to eager ZeRO-3 (a failed compile): plain torch.compile from here on
            return gm.forward
        gathered: Dict[int, int] = {}
        grad_ds_ids: List[Optional[int]] = []
        cut_inputs: List[Tuple[int, int]] = []
        try:
            param_ds_ids = runtime.param_ds_ids(example_inputs)
            grad_ds_ids = runtime.grad_ds_ids(example_inputs)
            gathered = {i: ds_id for i, ds_id in enumerate(param_ds_ids) if ds_id is not None}
            constant, undecided = causal_masks_pass(gm)  # before the sequence pass: a mask it need not cut
            stats.causal_masks += constant
            cut_inputs = shard_sequence_of(runtime, gm, stats)
            if runtime.tensor is not None:  # AutoTP's collectives where its layers' own are switched off
                stats.tensor_parallel_layers += place_tensor_collectives(gm, runtime.id)
            stats.run_time_masks += run_time_causal_pass(gm, undecided)  # on the attentions the passes above left
            uncompiled = GraphModule(gm, copy.deepcopy(gm.graph))  # the dynamo graph as traced, for other params
            gm = rewrite.insert_gathers_pass(gm, runtime_id=runtime.id, gathered_ds_ids=gathered)
            gm.recompile()
            compiler = GraphCompiler(runtime, stats, config, backend, param_ds_ids, on_failure, grad_ds_ids,
                                     inductor_config)
            compiler.split = bool(cut_inputs)
            # inductor's joint-graph passes, the forward, and the cache's key see them too
            with torch._inductor.config.patch(inductor_config):
                compiled = _aot_compile(compiler, gm, example_inputs)
        except RestartAnalysis:
            # dynamo's own control flow, not a failure: AOTAutograd asks dynamo to trace the frame again (with
            # dynamic shapes, a float scalar to be traced as a tensor); the next attempt compiles it
            raise
        except BaseException as err:
            on_failure(err, pairs_across_ranks(gathered, grad_ds_ids, torch.is_grad_enabled(), bool(cut_inputs)))
            raise
        compiled = graphs_of(runtime).wrap(compiled, runtime, gm, gathered, grad_ds_ids, uncompiled)
        if cut_inputs:  # a batch the sequence group cannot split is refused before the graph starts anything
            compiled = runtime.sequence.guard(compiled, cut_inputs)
        pairs = pairs_across_ranks(gathered, grad_ds_ids, torch.is_grad_enabled(), bool(cut_inputs))
        if pairs and runtime.peers.agrees_now():  # (the guard's first check of the batch agrees first)
            compiled = start_agreed(compiled, runtime)
        return compiled

    return compile_graph


def shard_sequence_of(runtime, gm: GraphModule, stats: CompileStats) -> List[Tuple[int, int]]:
    """Where the runtime has a sequence group, rewrite the dynamo graph for sequence parallelism before anything else
    (``graph/sequence.py``); returns the inputs it cut (placeholder index, sequence dimension)."""
    group = runtime.sequence
    if group is None:
        return []
    split = shard_sequence(gm, runtime.id, group.size, group.rank)
    stats.sequence_collectives += split.collectives
    if not split.cut_inputs:
        log.warning("deepspeed-compile: sequence parallelism found no token ids with a dynamic length in a graph "
                    "(an input named input_ids or inputs_embeds, or tagged by prepare_autosp_inputs): that graph "
                    "runs on the whole sequence on every rank of the group")
    if split.whole_ops and not stats.sequence_whole_ops:  # once per engine: the report counts every graph's
        ops = ", ".join(f"{name} (x{count})" for name, count in sorted(split.whole_ops.items()))
        logger.warning(f"deepspeed-compile: sequence parallelism ran these ops on the whole sequence, on every rank "
                       f"of the sequence group, their inputs gathered first (exact, but not split): {ops}. "
                       "engine_report(engine)['sequence_whole_ops'] counts them over every graph")
    for name, count in split.whole_ops.items():
        stats.sequence_whole_ops[name] = stats.sequence_whole_ops.get(name, 0) + count
    return split.cut_inputs


def pairs_across_ranks(gathered, grad_ds_ids: Sequence[Optional[int]], grad_enabled: bool,
                       split: bool = False) -> bool:
    """Whether a graph's runs issue collectives that every rank's run pairs with: it gathers (ZeRO-3), or its backward
    hands gradients to ZeRO (``grad_ds_ids``, with grad enabled), or, with grad enabled, it splits its sequence over
    the sequence group (``split``: training, where every rank's step ends in the gradients' reduction over the world,
    ZeRO-0's too). Others (a ZeRO-1/2 graph under ``no_grad``, as in an evaluation on one rank or one sequence group)
    may run on some ranks only, and agree on nothing."""
    return bool(gathered) or grad_enabled and (split or any(key is not None for key in grad_ds_ids))


def start_agreed(compiled: Callable, runtime) -> Callable:
    """The graph, marking the ranks' agreement due at its start and at its backward's (``runtime/agreement.py``):
    the runtime's next collective makes it, and where a rank could not run its graph, every rank raises there. The
    backward's start is when the first gradient reaches the graph's outputs, whether AOTAutograd compiled that
    backward or loaded it from its cache."""
    def run(*args):
        runtime.peers.graph_started()
        out = compiled(*args)
        grads_to_come = [t for t in (out if isinstance(out, (list, tuple)) else (out, ))
                         if isinstance(t, torch.Tensor) and t.requires_grad]
        if grads_to_come:
            torch.autograd.graph.register_multi_grad_hook(grads_to_come, lambda grad: runtime.peers.graph_started(),
                                                          mode="any")
        return out

    return run

# SPDX-License-Identifier: Apache-2.0
"""What compiling a graph does differently per ZeRO stage, in one place: the compile driver's stage parts.

[Note: stage parts] The compiler, the partition and the engine's activation are the same for every stage; where
ZeRO-3 (sharded parameters, gathered in the graphs) and ZeRO-1/2 (replicated parameters, gradients handed to ZeRO)
differ, they ask the engine's :class:`StageGraphs`, chosen once from the runtime's stage (:func:`graphs_of`). The
runtime's own stage parts are its classes (``runtime/z3.py``, ``runtime/z12.py``), behind one protocol
(``runtime/stage.py``).
"""
from typing import Callable, Dict, List, Optional

import torch
from torch.fx import GraphModule

from ..graph import rewrite
from ..graph.nodes import META_DS_ID, placeholders
from ..graph.recompute import choose_kept_by_reuse, choose_kept_params


class StageGraphs:
    """The protocol. ``leaf_regions``: with ``regions: "blocks"``, the parameter-owning modules outside the blocks are
    compiled as regions of their own (``regions.outer_leaves``)."""
    leaf_regions = False

    def prepare_joint(self, joint: GraphModule, num_fwd_outputs: int, grad_ds_ids: List[Optional[int]]) -> None:
        """Tag the joint graph before the partition."""

    def keep_key(self, compiler):
        """What decides a graph's kept parameters besides the graph (0: nothing is kept)."""
        return 0

    def kept(self, compiler, joint: GraphModule) -> Dict[int, int]:
        """The parameters kept gathered for backward in this joint graph: ds_id -> gathered bytes."""
        return {}

    def lowering(self, is_backward: bool, config) -> list:
        """The stage's passes at the head of the lowering (``GraphCompiler._lowering``)."""
        return []

    def wrap(self, compiled: Callable, runtime, gm: GraphModule, gathered: Dict[int, int],
             grad_ds_ids: List[Optional[int]], uncompiled: GraphModule) -> Callable:
        """The compiled graph as the engine calls it."""
        return compiled


class ShardedGraphs(StageGraphs):
    """ZeRO-3: parameters gathered in the graphs, some kept for backward; a graph serves any module of its code."""
    leaf_regions = True

    def keep_key(self, compiler):
        """``("reuse_distance", stage3_max_reuse_distance, eager ZeRO-3's prefetch window, elements of the sharded
        parameters outside this graph)``, or ``compile.keep_gathered_bytes`` in bytes (``"prefetch"``: one prefetch
        bucket of the parameters' dtype)."""
        keep, runtime = compiler.config.keep_gathered_bytes, compiler.runtime
        if keep == "reuse_distance":
            inside = set(compiler.param_ds_ids)
            outside = sum(p.ds_numel for ds_id, p in runtime.sharded.items() if ds_id not in inside)
            return ("reuse_distance", runtime.settings.max_reuse_distance, runtime.settings.prefetch_window, outside)
        return runtime.prefetch_bucket_bytes() if keep == "prefetch" else keep

    def kept(self, compiler, joint: GraphModule) -> Dict[int, int]:
        """The parameters ``compile.keep_gathered_bytes`` keeps gathered for backward."""
        keep = self.keep_key(compiler)
        if isinstance(keep, tuple):
            _, max_reuse_distance, prefetch_window, outside = keep
            return choose_kept_by_reuse(joint, max_reuse_distance, outside, prefetch_window)
        budget = keep - compiler.stats.kept_gathered_bytes
        return choose_kept_params(joint, budget) if budget > 0 else {}

    def wrap(self, compiled, runtime, gm, gathered, grad_ds_ids, uncompiled):
        # The ops find their parameters from the graph's inputs: the graph serves any module of the same code. Not a
        # parameter handed back as it is: its gradient's reduce can only name the traced parameter.
        if any(META_DS_ID not in node.meta for i, node in enumerate(placeholders(gm.graph)) if i in gathered):
            traced = {i: runtime.params[ds_id] for i, ds_id in gathered.items()}
            return bind_to_traced_params(compiled, uncompiled, traced, runtime)
        return compiled


class ReplicatedGraphs(StageGraphs):
    """ZeRO-1/2: nothing gathered; each reduce is handed its parameter, and each call announces the gradients its
    backward will hand over."""

    def prepare_joint(self, joint, num_fwd_outputs, grad_ds_ids):
        rewrite.mark_param_grads_pass(joint, num_fwd_outputs=num_fwd_outputs,
                                      grad_inputs=[i for i, ds_id in enumerate(grad_ds_ids) if ds_id is not None])

    def lowering(self, is_backward, config):
        # a backward's weight gradients computed by their reduces, into ZeRO-2's bucket where they go
        return [("fuse_matmul_reduces", rewrite.fuse_matmul_reduces_pass)] if (
            is_backward and config.fused_matmul_reduce) else []

    def wrap(self, compiled, runtime, gm, gathered, grad_ds_ids, uncompiled):
        return count_grad_sources(compiled, runtime, [i for i, ds_id in enumerate(grad_ds_ids) if ds_id is not None])


_BY_STAGE = {0: StageGraphs(), 1: ReplicatedGraphs(), 2: ReplicatedGraphs(), 3: ShardedGraphs()}


def graphs_of(runtime) -> StageGraphs:
    return _BY_STAGE[runtime.stage]


def bind_to_traced_params(compiled: Callable, uncompiled: GraphModule, traced: Dict[int, torch.nn.Parameter],
                          runtime) -> Callable:
    """A ZeRO-3 graph that hands a parameter back as it is bakes that parameter's ds_id into its reduce (the gradient
    arrives as a backward input, with no stand-in to name it), but dynamo guards a parameter input on its metadata only:
    it reuses one compiled graph for every module instance of the same code (the blocks of a model whose top-level
    frame it skipped, or regional compilation). A call with the parameters the graph was traced with runs the compiled
    graph; a call with other parameters runs the dynamo graph as traced, uncompiled, on those parameters (ZeRO-3
    gathers them first, ``runtime.prepare_uncompiled``), so it is still right: autograd then delivers their gradients
    through the runtime's eager gradient hooks."""
    def matches(args) -> bool:
        return all(args[i] is param for i, param in traced.items())

    @torch._dynamo.disable(recursive=True)
    def run_uncompiled(args):
        runtime.prepare_uncompiled([args[i] for i in traced])
        return uncompiled(*args)

    def run(*args):
        return compiled(*args) if matches(args) else run_uncompiled(args)

    return run


def count_grad_sources(compiled: Callable, runtime, grad_inputs: List[int]) -> Callable:
    """ZeRO-1/2: each call of a compiled graph tells the runtime which trained parameters will get a gradient from
    its backward, so that a parameter used by several graphs is handed to ZeRO once, with their sum."""
    def run(*args):
        runtime.note_graph_call(args, grad_inputs)
        return compiled(*args)

    return run

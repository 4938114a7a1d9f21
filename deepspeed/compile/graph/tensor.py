# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism (AutoTP) in a dynamo graph: the collectives of AutoTP's sharded linear layers placed in the
graph, where their layers' own are switched off (``runtime/tensor.py``).

A column-parallel layer (``LinearLayer``: its block of the output features) gets its input through ``tp_enter``,
whose gradient is summed over the group; layers reading the same input share one (their gradients add up before the
one all-reduce). A row-parallel layer (``LinearAllreduce``: its block of the input features) has its product summed
over the group by ``tp_sum`` before its bias is added, as the layer itself does. Each layer's product is found by its
module in the node's ``nn_module_stack`` (dynamo records which module each op was traced in): one ``matmul`` a layer.
Layers traced in a nested graph (a checkpointed region's body) get theirs there, and a layer traced in the graphs
without a product to place them after raises, naming it. In the backward graphs each sum is in flight while the weight
gradients are computed (:func:`overlap_tensor_sums`).
"""
from typing import Dict, List, Optional, Set, Tuple

import torch
from torch.fx import GraphModule, Node

from ..runtime import ops
from .nodes import is_reduce, is_reduce_mm, mutated_inputs

# the AutoTP layers whose collectives the graphs take over, by class name: column- or row-parallel
LAYER_KINDS = {"LinearLayer": "column", "LinearAllreduce": "row"}


_PRODUCTS = {torch.matmul, torch._C._nn.linear, torch.nn.functional.linear}


def _layer_of(node: Node) -> Optional[Tuple[str, str]]:
    """The innermost module ``node`` was traced in, as (its path in the traced model, its class's name). A node of a
    nested graph (a checkpointed region's body) keeps the stack it was traced with."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    return path, cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")


def graphs_of(gm: GraphModule) -> List[GraphModule]:
    """``gm`` and every graph nested in it: the bodies of higher-order ops (activation checkpointing's
    ``tag_activation_checkpoint``, ``wrap_with_autocast``, ...), which dynamo lifts into GraphModule attributes."""
    return [module for module in gm.modules() if isinstance(module, GraphModule)]


def _place_in(gm: GraphModule, runtime_id: int, placed: Dict[str, Node], reached: Set[str]) -> None:
    """Place the collectives of the AutoTP layers whose products are in ``gm``'s own graph (``placed``: each layer's
    product), and note every AutoTP layer any of its nodes was traced in (``reached``)."""
    entered: Dict[Node, Node] = {}  # an input -> its tp_enter, shared by the column-parallel layers reading it
    for node in list(gm.graph.nodes):
        layer = _layer_of(node)
        kind = LAYER_KINDS.get(layer[1]) if layer is not None else None
        if kind is None:
            continue
        reached.add(layer[0])
        if node.op != "call_function" or node.target not in _PRODUCTS:
            continue
        if layer[0] in placed:
            raise RuntimeError(f"deepspeed-compile: the AutoTP layer {layer[0]} computes more than one product in the "
                               "traced graph; its collective's place is not known")
        placed[layer[0]] = node
        if kind == "column":
            x = node.args[0]
            if x not in entered:
                first_op = next(n for n in gm.graph.nodes if n.op != "placeholder")
                with gm.graph.inserting_before(first_op) if x.op == "placeholder" else gm.graph.inserting_after(x):
                    entered[x] = gm.graph.call_function(ops.TP_ENTER, (x, runtime_id))
            node.update_arg(0, entered[x])
        else:
            users = list(node.users)
            with gm.graph.inserting_after(node):
                summed = gm.graph.call_function(ops.TP_SUM, (node, runtime_id))
            for user in users:
                user.replace_input_with(node, summed)
    gm.graph.lint()
    gm.recompile()


def place_tensor_collectives(gm: GraphModule, runtime_id: int) -> int:
    """Place the collectives of every AutoTP layer traced in ``gm`` or in a graph nested in it; returns how many layers
    got them. A layer with two products raises (its collective's place would be a guess), and so does a layer traced
    here whose product was not found: its own collectives are switched off, and it would compute without any."""
    placed: Dict[str, Node] = {}
    reached: Set[str] = set()
    for graph in graphs_of(gm):
        _place_in(graph, runtime_id, placed, reached)
    missed = sorted(reached - set(placed))
    if missed:
        raise RuntimeError(f"deepspeed-compile: the AutoTP layers {missed} were traced in a compiled graph without a "
                           "product (a matmul or linear) the graph's collectives could be placed after; their own "
                           "collectives are switched off, so they would compute without them. Compile without "
                           "'autotp' in compile.passes for this model")
    return len(placed)


def layer_kinds(module) -> "dict":
    """The AutoTP layers of ``module`` the graphs take over (name -> ``"column"`` or ``"row"``), and a ValueError
    naming the first tensor-parallel layer they cannot: another AutoTP layer class, or ``tp_overlap_comm``. A
    ``LinearLayer`` with ``gather_output`` gathers through ``autotp::gather_from_tp_region`` (``runtime/ops.py``)."""
    from deepspeed.module_inject.layers import TensorParallel_Layer
    kinds = {}
    for name, layer in module.named_modules():
        if not isinstance(layer, TensorParallel_Layer) or getattr(layer, "mp_group", None) is None:
            continue
        kind = LAYER_KINDS.get(type(layer).__name__)
        if kind is None or type(layer).tp_overlap_comm:
            raise ValueError(f"deepspeed-compile: the AutoTP compile pass places the collectives of AutoTP's "
                             f"LinearLayer and LinearAllreduce (without tp_overlap_comm); '{name}' is a "
                             f"{type(layer).__name__}")
        kinds[name] = kind
    return kinds


def _movable(node: Node) -> bool:
    """A node the overlap may run later: one that writes nothing, or a ZeRO-1/2 reduce (which hands its gradient to
    ZeRO's buckets; the reduces keep their order among themselves)."""
    return node.op == "call_function" and (not mutated_inputs(node) or is_reduce(node) or is_reduce_mm(node))


def overlap_tensor_sums(gm: GraphModule, runtime_id: int) -> int:
    """Each ``tp_sum`` of a backward graph split into ``tp_sum_start``, right after its addend is computed, and
    ``tp_sum_wait``, right before the sum's first reader, so that the code between them runs while the sum is in
    flight over the group. That code is what lay between the two already, and the code since the graph's previous
    sum that the addend does not depend on, moved after the start (the layers' weight gradients: a column-parallel
    layer's input gradient is the sum's addend, its weight gradient does not enter it). Moving a node that the addend
    does not depend on past the addend keeps every node after its inputs. Returns how many sums it split."""
    graph = gm.graph
    sums = [n for n in graph.nodes if n.op == "call_function" and n.target is ops.TP_SUM]
    floor: Optional[Node] = None  # the last wait placed: nothing moves across it
    for summed in sums:
        addend = summed.args[0]
        needed = set()  # the addend and everything it is computed from
        stack = [addend]
        while stack:
            node = stack.pop()
            if node not in needed:
                needed.add(node)
                stack.extend(node.all_input_nodes)
        order = {n: i for i, n in enumerate(graph.nodes)}
        low = order[floor] if floor is not None else -1
        movable = [n for n in graph.nodes if low < order[n] < order[addend] and n not in needed and _movable(n)]
        if addend.op == "placeholder":
            place = next(n for n in graph.nodes if n.op != "placeholder").prev
        else:
            place = addend
        with graph.inserting_after(place):
            start = graph.call_function(ops.TP_SUM_START, (addend, runtime_id))
        start.meta["val"] = summed.meta.get("val")
        last = start
        for node in movable:
            last.append(node)
            last = node
        first_reader = min(summed.users, key=lambda n: order[n])
        with graph.inserting_before(first_reader):
            floor = graph.call_function(ops.TP_SUM_WAIT, (start, runtime_id))
        summed.replace_all_uses_with(start)
        graph.erase_node(summed)
    graph.lint()
    gm.recompile()
    return len(sums)

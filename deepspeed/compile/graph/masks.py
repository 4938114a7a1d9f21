# SPDX-License-Identifier: Apache-2.0
"""Causal masks that a traced model materializes, handed back to attention as ``is_causal``.

``transformers`` decides between a causal mask tensor and SDPA's ``is_causal`` by reading values: eagerly it finds
the positions consecutive and no token padded, and passes ``is_causal=True``; under tracing it cannot read them, so
the graph builds the ``[B, 1, S, S]`` mask from ``arange``s (the packed-sequence check of a model run without a
cache, as in training) and attention takes the masked kernel, which cannot skip the masked half as the causal one
does. Where such a mask depends on no input of the graph and its sizes are concrete, it is a constant: this
pass computes it once at compile time, and where it is exactly the causal pattern of a square attention (what
``is_causal=True`` applies), the attention gets ``is_causal=True`` and no mask, as the eager model does. A mask
computed from an input (a padding mask, given position ids) or over symbolic sizes cannot be decided at compile
time: on CPU such an attention becomes ``dsc::attention`` (``run_time_causal_pass``), which decides once per graph run
from the mask's values (``dsc::causal_flag``), as the eager model would, and runs SDPA's CPU kernel causal or masked.
"""
import logging
import operator
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node

from ..runtime import ops

log = logging.getLogger(__name__)

_ATTENTION = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
# ops whose values are not a function of their arguments: a mask computed with one is not a constant
_UNSEEDED = ("rand", "bernoulli", "normal", "uniform", "multinomial", "dropout", "empty", "exponential")
# the largest mask computed at compile time (elements, batch rows included): 8 rows of 4096 x 4096 tokens, 128 MiB of
# booleans for each intermediate of its computation, once per graph
_MAX_MASK_NUMEL = 1 << 27


def _mask_of(node: Node) -> Optional[Node]:
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    return mask if isinstance(mask, Node) else None


def _constant_subgraph(mask: Node) -> Optional[List[Node]]:
    """The nodes ``mask`` is computed from, in graph order, where none is an input, a parameter (trained: its
    values change), a module call or an op with random or uninitialized values; else None."""
    seen: Dict[Node, None] = {}
    todo = [mask]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        if node.op not in ("call_function", "call_method", "get_attr"):
            return None
        if node.op == "get_attr" and isinstance(_attribute(node), torch.nn.Parameter):
            return None
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        if any(word in name for word in _UNSEEDED):
            return None
        seen[node] = None
        todo.extend(node.all_input_nodes)
    order = {node: i for i, node in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _attribute(node: Node):
    owner = node.graph.owning_module
    for name in node.target.split("."):
        owner = getattr(owner, name, None)
    return owner


def _evaluate(gm: GraphModule, nodes: List[Node]) -> Optional[torch.Tensor]:
    """Run the constant subgraph ``nodes`` (its last node the mask) on real tensors; None where it cannot run."""
    value = nodes[-1].meta.get("example_value")
    if not isinstance(value, torch.Tensor) or not all(isinstance(d, int) for d in value.shape) \
            or value.numel() > _MAX_MASK_NUMEL:
        return None
    graph = Graph()
    env: Dict[Node, Node] = {}
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[nodes[-1]])
    try:
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
            out = GraphModule(gm, graph)()
    except Exception as err:  # an op that cannot run outside the trace: the mask stays as traced
        log.debug("deepspeed-compile: a constant attention mask could not be computed: %s", err)
        return None
    return out if isinstance(out, torch.Tensor) else None


def _is_causal(mask: torch.Tensor, length: int) -> bool:
    """Whether ``mask`` is exactly the causal mask of a ``length`` x ``length`` attention (``ops.is_causal_mask``,
    which the run-time decision uses too)."""
    return mask.dim() >= 2 and tuple(mask.shape[-2:]) == (length, length) and ops.is_causal_mask(mask)


def _options(node: Node) -> dict:
    """An SDPA node's arguments after the mask, by name: dropout_p, is_causal, scale (and enable_gqa)."""
    return {**dict(zip(("dropout_p", "is_causal", "scale"), node.args[4:])), **node.kwargs}


def causal_masks_pass(gm: GraphModule) -> Tuple[int, List[Node]]:
    """Give every attention of ``gm`` whose mask is a constant causal one ``is_causal=True`` instead; returns how many
    attentions were changed, and the attentions whose mask is no constant that ``run_time_causal_pass`` can take
    (read from the graph as traced: run it on them once the other passes are done). The mask's nodes that nothing
    else reads are removed."""
    verdicts: Dict[Node, Optional[bool]] = {}  # None: not a constant
    undecided: List[Node] = []
    computed: Dict[Node, None] = {}  # the nodes of the masks replaced
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _ATTENTION:
            continue
        mask = _mask_of(node)
        if mask is None:
            continue
        query, key = (arg.meta.get("example_value") if isinstance(arg, Node) else None for arg in node.args[:2])
        if not all(isinstance(t, torch.Tensor) for t in (query, key)):
            continue
        length, key_length = query.shape[-2], key.shape[-2]
        if not (isinstance(length, int) and isinstance(key_length, int)):  # symbolic: decided at run time
            if _decidable_at_run_time(node, mask):
                undecided.append(node)
            continue
        if key_length != length:  # a causal mask means a square attention
            continue
        if mask not in verdicts:
            nodes = _constant_subgraph(mask)
            value = _evaluate(gm, nodes) if nodes is not None else None
            verdicts[mask] = None if value is None else _is_causal(value, length)
            if verdicts[mask]:
                computed.update(dict.fromkeys(nodes))
        if verdicts[mask] is None and _decidable_at_run_time(node, mask):
            undecided.append(node)
        if not verdicts[mask]:
            continue
        node.args, node.kwargs = node.args[:3], {**_options(node), "attn_mask": None, "is_causal": True}
        changed += 1
    if changed:
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        for node in sorted(computed, key=order.__getitem__, reverse=True):  # readers before what they read
            if not node.users:
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
    return changed, undecided


def _decidable_at_run_time(node: Node, mask: Node) -> bool:
    """Whether ``dsc::attention`` computes what the SDPA ``node`` does, bitwise: on CPU, the fused kernel SDPA
    itself takes there (4-d operands with as many key/value heads as query heads, no dropout, no other flag), in
    one dtype (so not where autocast would cast them), a mask that no gradient reaches."""
    query, key, value, out, mask_value = (_example(arg) for arg in (*node.args[:3], node, mask))
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value, out, mask_value)):
        return False
    extra = _options(node)
    # (grouped key/value heads: fewer than the query's, refused below, with or without enable_gqa)
    if extra.get("dropout_p", 0.0) != 0.0 or extra.get("is_causal", False) \
            or not isinstance(extra.get("scale"), (float, type(None))):
        return False
    dtype = query.dtype
    return (query.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(t.dim() == 4 and t.dtype == dtype for t in (query, key, value, out))
            and query.shape[1] == key.shape[1] == value.shape[1] and not mask_value.requires_grad
            and (mask_value.dtype == torch.bool or mask_value.dtype == dtype))


def _example(node) -> Optional[torch.Tensor]:
    return node.meta.get("example_value") if isinstance(node, Node) else None


def run_time_causal_pass(gm: GraphModule, attentions: List[Node]) -> int:
    """Turn each SDPA of ``attentions`` (``causal_masks_pass``'s undecided ones) into ``dsc::attention``, its mask's
    verdict computed once per graph run for all the attentions reading that mask; returns how many."""
    flags: Dict[Node, Node] = {}
    graph = gm.graph
    for node in attentions:
        mask = _mask_of(node)  # the mask as the other passes left it (the sequence pass gathers a split one)
        scale = _options(node).get("scale")
        with graph.inserting_before(node):
            if mask not in flags:
                flags[mask] = graph.call_function(ops.CAUSAL_FLAG, (mask, ))
            both = graph.call_function(ops.ATTENTION, (*node.args[:3], mask, flags[mask], scale))
            out = graph.call_function(operator.getitem, (both, 0))
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    if attentions:
        graph.lint()
        gm.recompile()
    return len(attentions)

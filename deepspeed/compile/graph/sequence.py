# SPDX-License-Identifier: Apache-2.0
"""Sequence parallelism (Ulysses) as a rewrite of a dynamo graph: each rank of a sequence group computes its block
of every sequence, and exchanges heads for sequence around attention.

The pass follows where the sequence goes. The ranks of a group are fed the same batch; the graph's token ids are
cut to this rank's block right after they enter (``narrow``), and from there every value carries a *layout*:

- full (no entry): the whole value, the same on every rank of the group;
- :class:`Block` ``(dim, outer)``: this rank's block of the sequence along ``dim``; ``outer > 1`` where ``dim`` merges
  ``outer`` leading positions with the sequence (a ``[batch * seq, hidden]`` view: each row block is one batch row's
  block);
- ``PARTIAL``: this rank's addend of a sum over the sequence (a loss summed over its block).

Each op is rewritten by a rule for its kind (``graph/sequence_rules.py`` holds the tables): an elementwise op, a
per-position op (a linear layer, a norm, an embedding, a softmax or a reduction over another dimension than the
block's) or a view keeps the block, and a full operand meeting a block is cut to the same block (the rotary table,
the position embedding, the labels); ``scaled_dot_product_attention`` gets an all-to-all before it (each rank then
holds the whole sequence for ``heads / size`` heads, with the mask's heads cut to match) and one after; a
cross-entropy over a block sums its losses, adds the sums over the group and divides by the number of counted labels
of the whole batch. A per-position op reads its block only where it reads nothing across the block's dimension: a
softmax, a norm or a sum over the sequence is no per-position op of that block. Any op no rule takes gets the blocks
it reads gathered first, and runs on the full values (counted by op: :attr:`SequencePass.whole_ops`). So every op
computes from values that hold what it reads, and the rewrite is exact for any graph, random ops aside (a dropout
draws its mask per block, as a different seed would), and parallel where the rules reach. A graph's outputs are
returned full.

Sizes: the sequence length is a symbol of the dynamo graph (the engine marks the token ids' sequence dimension
dynamic). An op whose input is a block and whose size arguments name that symbol (``view(b, s, heads, d)``) gets
``s // size`` instead.

[Note: gradients of a sharded sequence] Each collective's gradient is its adjoint: an all-gather's is a
reduce-scatter (sum over the group, this rank's block), an all-reduce's is an all-reduce, an all-to-all's is the
reverse all-to-all; a full value cut to a block passes its block's gradient back, zero elsewhere. With the ranks'
full values equal, each rank's backward then gives a parameter ``size`` times its share of the unsharded gradient:
the share of the positions it computed, with full computations counted once per rank. The group's sum is ``size``
times the unsharded gradient, and ZeRO's average over the whole world (``size`` times the data-parallel degree)
divides it out: the gradients of every stage are those of the unsharded model, up to the order of the sums.
"""
import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import sympy
import torch
from torch.fx import GraphModule, Node

from .. import constants
from ..runtime import ops
from .sequence_rules import (ATTENTION, ELEMENTWISE_FUNCS, ELEMENTWISE_METHODS, FULL_RESULT_METHODS, LOSSES, PERMUTE,
                             SPLIT, VIEW_FUNCS, VIEW_METHODS, body_call, op_name, per_position_reads, position_of)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Block:
    dim: int
    outer: int = 1


PARTIAL = "partial"
BODY = "body"  # a call of a body graph: its outputs' layouts are in ``SequencePass.body_outputs``
Layout = Union[Block, str, None]

# names of the graph inputs cut to the rank's block where they enter (dynamo names a placeholder after its source)
SEED_NAMES = ("input_ids", "inputs_embeds")

def tagged_dim(node: Node, key: str) -> Optional[int]:
    """The sequence dimension of a graph input tagged ``key`` the stock AutoSP way (``tensor.tag``, which dynamo keeps
    in ``meta["tensor_dict"]``): ``(key, seq_dim)`` as ``prepare_autosp_inputs`` sets it, or the bare key (dimension
    1); None where the input is not tagged ``key``."""
    tag = node.meta.get("tensor_dict", {}).get("tag")
    if isinstance(tag, tuple) and len(tag) == 2 and tag[0] == key and isinstance(tag[1], int):
        return tag[1]
    return 1 if isinstance(tag, str) and tag == key else None


def _value(node: Any):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else None


def _expr(size) -> Optional[sympy.Expr]:
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return sympy.Integer(size) if isinstance(size, int) else None


class SequencePass:
    """One graph's rewrite. ``runtime_id``: the runtime whose sequence group the collectives run on
    (``runtime/sequence.py``); ``size`` and ``rank``: the group's."""

    def __init__(self, gm: GraphModule, runtime_id: int, size: int, rank: int,
                 parent: Optional["SequencePass"] = None):
        self.gm, self.graph = gm, gm.graph
        self.parent = parent  # the pass of the graph that calls this one, a body (:meth:`_body`)
        self.runtime_id, self.size, self.rank = runtime_id, size, rank
        self.layout: Dict[Node, Layout] = {}
        self.seq: Optional[sympy.Symbol] = None  # the sequence length's symbol
        self.seq_node: Optional[Node] = None
        self.local_len: Optional[Node] = None  # seq // size
        self.start: Optional[Node] = None  # rank * (seq // size)
        self.full_of: Dict[Node, Node] = {}  # a block -> its gathered value, gathered once
        self.traced: Dict[Node, Any] = {}  # a node this pass made -> the traced (full) value it holds a block of
        self.collectives = 0
        self.seeds: List[Tuple[Node, int]] = []  # the inputs cut where they enter, with their sequence dimension
        self.whole_ops: Dict[str, int] = {}  # ops run on the whole sequence (their blocks gathered), by op
        self.body_outputs: Dict[Node, List[Layout]] = {}  # a call of a body graph -> its outputs' layouts

    # --- set-up --------------------------------------------------------------------------------------------
    def _seeds(self) -> List[Tuple[Node, int]]:
        """The graph inputs cut where they enter, with their sequence dimension: those tagged as token ids
        (``constants.AUTOSP_INPUT_ID_KEY``, :func:`tagged_dim`), else those named after token ids or embeddings. Labels
        and position ids, tagged or not, enter whole and are cut where they meet a block."""
        seeds = []
        for node in self.graph.nodes:
            value = _value(node)
            if node.op != "placeholder" or not isinstance(value, torch.Tensor):
                continue
            dim = tagged_dim(node, constants.AUTOSP_INPUT_ID_KEY)
            if dim is not None:
                seeds.append((node, dim % value.dim()))
            elif any(node.name.lower().rstrip("_").endswith(name) for name in SEED_NAMES) and value.dim() >= 2:
                seeds.append((node, 1))
        return seeds

    def _find_sequence(self, seeds) -> bool:
        for node, dim in seeds:
            size = _value(node).shape[dim]
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                self.seq = size.node.expr
                break
        if self.seq is None:
            return False
        for node in self.graph.nodes:
            value = _value(node)
            if isinstance(value, torch.SymInt) and value.node.expr == self.seq:
                self.seq_node = node
                break
        if self.seq_node is None:
            return False
        first_op = next(node for node in self.graph.nodes if node.op != "placeholder")
        self.local_len = self._insert_before(first_op, operator.floordiv, (self.seq_node, self.size))
        self.start = self._insert_before(first_op, operator.mul, (self.local_len, self.rank))
        return True

    def _multiple(self, size) -> Optional[int]:
        """``c`` where ``size`` is ``c * seq`` for a positive integer ``c``, else None."""
        expr = _expr(size)
        if expr is None or self.seq is None or not expr.has(self.seq):
            return None
        coeff = sympy.simplify(expr / self.seq)
        return int(coeff) if coeff.is_Integer and coeff > 0 else None

    def _has_seq(self, value) -> bool:
        return isinstance(value, torch.Tensor) and any(_expr(s) is not None and _expr(s).has(self.seq)
                                                       for s in value.shape)

    # --- run ---------------------------------------------------------------------------------------------
    def run(self) -> bool:
        """Rewrite the graph; False (and the graph unchanged) where it has no token ids with a symbolic length."""
        seeds = self._seeds()
        if not seeds or not self._find_sequence(seeds):
            return False
        self.seeds = seeds
        for node, dim in seeds:
            self._cut_seed(node, dim)
        self._walk()
        return True

    def _walk(self) -> List[Layout]:
        """Rewrite every op; a graph's outputs are gathered, a body's keep their layouts (returned)."""
        outputs: List[Layout] = []
        for node in list(self.graph.nodes):
            if node.op in ("call_function", "call_method") and node not in self.layout:
                self._rewrite(node)
            elif node.op == "output" and self.parent is None:
                self._finish_outputs(node)
            elif node.op == "output":
                outputs = [self.layout.get(arg) if isinstance(arg, Node) else None for arg in node.args[0]]
        self.graph.lint()
        self.gm.recompile()
        return outputs

    def _cut_seed(self, node: Node, dim: int) -> None:
        users = list(node.users)
        if not users:
            return
        block = self._insert_before(self.start.next, torch.narrow, (node, dim, self.start, self.local_len))
        for user in users:
            user.replace_input_with(node, block)
        self.layout[block] = Block(dim)
        self.traced[block] = _value(node)

    # --- helpers -------------------------------------------------------------------------------------------
    def _insert_before(self, node: Node, target, args, kwargs=None, method: bool = False) -> Node:
        with self.graph.inserting_before(node):
            if method:
                return self.graph.call_method(target, args, kwargs or {})
            return self.graph.call_function(target, args, kwargs or {})

    def _value(self, node: Any):
        """The traced value of ``node``: the full one, for a block."""
        return self.traced[node] if node in self.traced else _value(node)

    def _inputs(self, node: Node) -> List[Node]:
        return [arg for arg in node.all_input_nodes
                if arg in self.layout or isinstance(self._value(arg), (torch.Tensor, tuple, list))]

    def _gather(self, before: Node, block: Node) -> Node:
        """The full value of a block (gathered once per block)."""
        if block in self.full_of:
            return self.full_of[block]
        layout = self.layout[block]
        self.collectives += 1
        if layout == PARTIAL:
            full = self._insert_before(before, ops.SEQ_ALL_REDUCE, (block, self.runtime_id))
        elif layout.outer == 1:
            full = self._insert_before(before, ops.SEQ_ALL_GATHER,
                                       (block, self.runtime_id, layout.dim, self.seq_node))
        else:
            split = self._insert_before(before, "unflatten", (block, layout.dim, (layout.outer, -1)), method=True)
            gathered = self._insert_before(before, ops.SEQ_ALL_GATHER,
                                           (split, self.runtime_id, layout.dim + 1, self.seq_node))
            full = self._insert_before(before, "flatten", (gathered, layout.dim, layout.dim + 1), method=True)
        self.full_of[block] = full
        return full

    def _cut(self, before: Node, full: Node, dim: int, outer: int) -> Node:
        """This rank's block of a full value along ``dim``."""
        if outer == 1:
            return self._insert_before(before, torch.narrow, (full, dim, self.start, self.local_len))
        split = self._insert_before(before, "unflatten", (full, dim, (outer, -1)), method=True)
        cut = self._insert_before(before, torch.narrow, (split, dim + 1, self.start, self.local_len))
        return self._insert_before(before, "flatten", (cut, dim, dim + 1), method=True)

    def _fall_back(self, node: Node) -> None:
        """Run ``node`` on full values: gather each block it reads (counted in :attr:`whole_ops`)."""
        blocks = [arg for arg in self._inputs(node) if isinstance(self.layout.get(arg), Block)]
        if blocks:
            name = op_name(node)
            self.whole_ops[name] = self.whole_ops.get(name, 0) + 1
        for arg in self._inputs(node):
            if self.layout.get(arg) is not None:
                node.replace_input_with(arg, self._gather(node, arg))

    def _local_sizes(self, node: Node) -> None:
        """Size arguments naming the sequence length (or a multiple) become the block's."""
        def local(arg):
            if isinstance(arg, Node):
                value = _value(arg)
                if isinstance(value, torch.SymInt):
                    times = self._multiple(value)
                    if times == 1:
                        return self.local_len
                    if times is not None:
                        return self._insert_before(node, operator.mul, (self.local_len, times))
                if arg.op == "call_function" and arg.target is torch.Size and self.layout.get(arg) is None:
                    new_args = torch.fx.node.map_aggregate(arg.args, local)
                    if new_args != arg.args:
                        return self._insert_before(node, torch.Size, new_args)
                return arg
            return arg
        node.args = torch.fx.node.map_aggregate(node.args, local)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, local)

    # --- the rules -----------------------------------------------------------------------------------------
    def _rewrite(self, node: Node) -> None:
        if node.target is operator.getitem and node.args[0] in self.body_outputs:
            layout = self.body_outputs[node.args[0]][node.args[1]]
            if layout is not None:
                self.layout[node] = layout
            return
        inputs = self._inputs(node)
        layouts = {arg: self.layout.get(arg) for arg in inputs}
        if all(layout is None for layout in layouts.values()):
            return
        target = node.target
        method = node.op == "call_method"
        if method and target in FULL_RESULT_METHODS:
            return
        partial = [arg for arg, layout in layouts.items() if layout == PARTIAL]
        if partial:
            if self._partial_rule(node, layouts):
                return
            for arg in partial:
                node.replace_input_with(arg, self._gather(node, arg))
            layouts = {arg: self.layout.get(arg) for arg in self._inputs(node)}
            if all(layout is None for layout in layouts.values()):
                return
        rule = None
        if (method and target in ELEMENTWISE_METHODS) or (not method and target in ELEMENTWISE_FUNCS):
            rule = self._elementwise
        elif per_position_reads(node) is not None:
            rule = self._per_position
        elif (method and target in VIEW_METHODS) or (not method and target in VIEW_FUNCS):
            rule = self._view
        elif target in PERMUTE:
            rule = self._permute
        elif target in SPLIT:
            rule = self._split
        elif target is torch.cat:
            rule = self._cat
        elif target in ATTENTION:
            rule = self._attention
        elif target in LOSSES:
            rule = self._loss
        elif body_call(node) is not None:
            rule = self._body
        layout = rule(node, layouts) if rule is not None else None
        if layout is None:
            self._fall_back(node)
            return
        self.layout[node] = layout

    def _partial_rule(self, node: Node, layouts) -> bool:
        """A sum's addends stay addends through a scaling by a full value, or a sum of addends."""
        target = node.target
        if target in (operator.truediv, operator.mul, torch.div, torch.mul, "div", "mul", "float", "to"):
            others = [arg for arg, layout in layouts.items() if layout != PARTIAL]
            first_partial = layouts.get(node.args[0]) == PARTIAL
            if target in (operator.truediv, torch.div, "div") and not first_partial:
                return False
            if all(layout is None and self._value(arg).dim() == 0 for arg, layout in layouts.items() if arg in others):
                self.layout[node] = PARTIAL
                return True
        if target in (operator.add, torch.add, "add") and all(layout == PARTIAL for layout in layouts.values()):
            self.layout[node] = PARTIAL
            return True
        return False

    def _full_operand_cut(self, arg: Node, out_ndim: int, out_dim: int, outer: int) -> Union[bool, int]:
        """How a full operand broadcast against a block along output dimension ``out_dim`` takes part: the
        dimension to cut it along, True where it broadcasts there as it is, False where it holds the sequence
        elsewhere (no rule applies)."""
        value = self._value(arg)
        if not isinstance(value, torch.Tensor):
            return True
        dim = out_dim - (out_ndim - value.dim())
        if any(d != dim and self._multiple(size) is not None for d, size in enumerate(value.shape)):
            return False
        if dim < 0 or (isinstance(value.shape[dim], int) and value.shape[dim] == 1):
            return True
        return dim if self._multiple(value.shape[dim]) == outer else False

    def _elementwise(self, node: Node, layouts) -> Optional[Block]:
        out = _value(node)
        if not isinstance(out, torch.Tensor):
            return None
        placed = {(layout.dim + out.dim() - self._value(arg).dim(), layout.outer)
                  for arg, layout in layouts.items() if isinstance(layout, Block)}
        if len(placed) != 1:
            return None
        out_dim, outer = placed.pop()
        cuts = {arg: self._full_operand_cut(arg, out.dim(), out_dim, outer)
                for arg, layout in layouts.items() if layout is None}
        if any(cut is False for cut in cuts.values()):
            return None
        for arg, cut in cuts.items():
            if cut is not True:
                node.replace_input_with(arg, self._cut(node, arg, cut, outer))
        # a length among an elementwise op's operands is a value (``x * seq``, ``positions / seq``), kept whole
        return Block(out_dim, outer)

    def _follow_shape(self, node: Node, layout: Block, value_in) -> Optional[Block]:
        """Where the block's dimension is in ``node``'s output, by the positions before it: the output dimension
        holding ``c * seq`` whose leading dimensions hold as many positions as the input's before the block's."""
        out = _value(node)
        if not isinstance(out, torch.Tensor):
            return None
        before = _expr(1)
        for size in value_in.shape[:layout.dim]:
            if _expr(size) is None or _expr(size).has(self.seq):
                return None
            before = before * _expr(size)
        before = before * layout.outer
        found = None
        leading = _expr(1)
        for d, size in enumerate(out.shape):
            times = self._multiple(size)
            if times is not None:
                if found is not None:
                    return None
                if sympy.simplify(leading * times - before) == 0:
                    found = Block(d, times)
                else:
                    return None
            else:
                if _expr(size) is None:
                    return None
                leading = leading * _expr(size)
        return found

    def _per_position(self, node: Node, layouts) -> Optional[Block]:
        blocks = [(arg, layout) for arg, layout in layouts.items() if isinstance(layout, Block)]
        if len(blocks) != 1:
            return None
        arg, layout = blocks[0]
        for other, other_layout in layouts.items():
            if other is not arg and (other_layout is not None or self._has_seq(self._value(other))):
                return None
        position = position_of(node, arg)
        # an op that reads across the block's dimension (a softmax or a norm over the sequence) needs every position
        if position is None or layout.dim in per_position_reads(node)(node, position, self._value(arg).dim()):
            return None
        found = self._follow_shape(node, layout, self._value(arg))
        if found is not None:
            self._local_sizes(node)
        return found

    def _view(self, node: Node, layouts) -> Optional[Block]:
        if node.target is operator.getitem:
            index = node.args[1]
            if isinstance(self._value(node.args[0]), (tuple, list)):  # an element of a split
                return layouts.get(node.args[0]) if isinstance(index, int) else None
            indices: List[Node] = []
            torch.fx.node.map_arg(index, indices.append)
            if indices:  # indexing by tensors: positions move
                return None
        blocks = [(arg, layout) for arg, layout in layouts.items() if isinstance(layout, Block)]
        if len(blocks) != 1 or blocks[0][0] is not node.args[0]:
            return None
        arg, layout = blocks[0]
        if node.target == "expand":  # broadcasts dimensions of size 1: the block's dimension stays where it is
            out = _value(node)
            dim = layout.dim + out.dim() - self._value(arg).dim()
            found = Block(dim, layout.outer) if self._multiple(out.shape[dim]) == layout.outer else None
        else:
            found = self._follow_shape(node, layout, self._value(arg))
        if found is not None:
            self._local_sizes(node)
        return found

    def _permute(self, node: Node, layouts) -> Optional[Block]:
        layout = layouts.get(node.args[0])
        if not isinstance(layout, Block) or len(layouts) != 1:
            return None
        ndim = self._value(node.args[0]).dim()
        if node.target in (torch.transpose, "transpose"):
            a, b = (d % ndim for d in node.args[1:3])
            return Block(b if layout.dim == a else a if layout.dim == b else layout.dim, layout.outer)
        order = node.args[1:] if not isinstance(node.args[1], (tuple, list)) else node.args[1]
        order = [d % ndim for d in order]
        return Block(order.index(layout.dim), layout.outer)

    def _split(self, node: Node, layouts) -> Optional[Block]:
        layout = layouts.get(node.args[0])
        if not isinstance(layout, Block) or len(layouts) != 1:
            return None
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0) % self._value(node.args[0]).dim()
        return layout if dim != layout.dim else None

    def _cat(self, node: Node, layouts) -> Optional[Block]:
        tensors = node.args[0]
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        # an empty 1-D tensor is skipped by cat (a key/value cache's first entry)
        kept = [t for t in tensors
                if not (isinstance(self._value(t), torch.Tensor) and tuple(self._value(t).shape) == (0, ))]
        blocks = {layouts.get(t) for t in kept}
        if len(blocks) != 1 or not isinstance(next(iter(blocks)), Block):
            return None
        layout = next(iter(blocks))
        if len(kept) == 1 or dim % self._value(kept[0]).dim() != layout.dim:
            return layout
        return None

    def _attention(self, node: Node, layouts) -> Optional[Block]:
        """q, k, v ``[batch, heads, seq, dim]`` in blocks of the sequence: exchanged for the whole sequence of
        ``heads / size`` heads, attention there, and back."""
        q, k, v = node.args[:3]
        if any(layouts.get(t) != Block(2) for t in (q, k, v)):
            return None
        q_heads = self._value(q).shape[1]
        if not isinstance(q_heads, int) or q_heads % self.size:
            raise ValueError(f"deepspeed-compile: sequence parallelism splits attention's heads between the ranks of "
                             f"a sequence group: the query has {q_heads} heads, which sequence_parallel_size="
                             f"{self.size} does not divide")
        for t in (k, v):
            kv_heads = self._value(t).shape[1]
            if kv_heads % self.size:
                # grouped-query attention with fewer key/value heads than ranks: each rank's block of query heads
                # gets the key/value heads it reads, repeated as attention would
                repeated = self._insert_before(node, "repeat_interleave", (t, q_heads // kv_heads),
                                               {"dim": 1}, method=True)
                node.replace_input_with(t, repeated)
                k, v = (repeated if x is t else x for x in (k, v))
        for t in (q, k, v):  # [batch, heads, seq / size, dim] -> [batch, heads / size, seq, dim]
            exchanged = self._insert_before(node, ops.SEQ_ALL_TO_ALL, (t, self.runtime_id, 1, 2, self.seq_node))
            node.replace_input_with(t, exchanged)
            self.collectives += 1
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        if isinstance(mask, Node):
            if self.layout.get(mask) is not None:
                mask_full = self._gather(node, mask)
            else:
                mask_full = mask
            value = self._value(mask)
            if value.dim() == 4 and value.shape[1] != 1:
                local_heads = value.shape[1] // self.size
                mask_full = self._insert_before(node, torch.narrow,
                                                (mask_full, 1, self.rank * local_heads, local_heads))
            if mask_full is not mask:
                node.replace_input_with(mask, mask_full)
        users = list(node.users)
        with self.graph.inserting_after(node):
            back = self.graph.call_function(ops.SEQ_ALL_TO_ALL, (node, self.runtime_id, 2, 1, q_heads))
        self.collectives += 1
        for user in users:
            user.replace_input_with(node, back)
        self.layout[back] = Block(2)
        self.traced[back] = _value(node)
        return Block(2)  # the exchanged result: never read but by ``back``

    def _loss(self, node: Node, layouts) -> Optional[Layout]:
        """``cross_entropy`` / ``nll_loss`` of logits in blocks of positions: summed over the block, and the mean's
        division by the counted labels done on the whole batch's labels (after the sums are added)."""
        logits = node.args[0]
        target = node.kwargs.get("target", node.args[1] if len(node.args) > 1 else None)
        layout = layouts.get(logits)
        if not isinstance(layout, Block) or self._value(logits).dim() != 2 or layout.dim != 0 \
                or node.kwargs.get("weight") is not None or len(node.args) > 2 or not isinstance(target, Node):
            return None
        reduction = node.kwargs.get("reduction", "mean")
        ignore_index = node.kwargs.get("ignore_index", -100)
        target_layout = layouts.get(target)
        if target_layout is None:
            if self._multiple(self._value(target).shape[0]) != layout.outer:
                return None
            full_target = target
            node.replace_input_with(target, self._cut(node, target, 0, layout.outer))
        elif target_layout == layout:
            full_target = self._gather(node, target)
        else:
            return None
        if reduction == "none":
            return layout
        node.update_kwarg("reduction", "sum")
        self.layout[node] = PARTIAL
        users = list(node.users)
        with self.graph.inserting_after(node):
            total = self.graph.call_function(ops.SEQ_ALL_REDUCE, (node, self.runtime_id))
        self.collectives += 1
        result = total
        if reduction == "mean":
            with self.graph.inserting_after(total):
                counted = self.graph.call_function(operator.ne, (full_target, ignore_index))
            with self.graph.inserting_after(counted):
                count = self.graph.call_method("sum", (counted, ))
            with self.graph.inserting_after(count):
                result = self.graph.call_function(operator.truediv, (total, count))
        for user in users:
            user.replace_input_with(node, result)
        self.layout[total] = None
        return PARTIAL

    def _body(self, node: Node, layouts) -> Optional[str]:
        """A call of a body graph (a checkpointed region, an autocast region: ``sequence_rules.BODY_CALLS``): the
        body rewritten by these rules in place, its placeholders given their operands' layouts and the sequence's
        length, the block's length and its start passed in after the operands; its outputs keep their layouts (a
        region of blocks returns blocks), read by the ``getitem`` after the call. A body called more than once, or
        whose outputs are not one flat tuple read by index, is not rewritten (None: it runs on the whole sequence)."""
        at = body_call(node)
        attr = node.args[at]
        body = getattr(self.gm, attr.target, None)
        operands = list(node.args[at + 1:])
        if not isinstance(body, GraphModule) or len(attr.users) != 1 or any(
                user.target is not operator.getitem or not isinstance(user.args[1], int) for user in node.users):
            return None
        body.graph.eliminate_dead_code()  # dynamo leaves a body's unread ``size()`` calls, which would gather
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        output = next(n for n in body.graph.nodes if n.op == "output")
        if len(placeholders) != len(operands) or not isinstance(output.args[0], (tuple, list)):
            return None
        inner = SequencePass(body, self.runtime_id, self.size, self.rank, parent=self)
        inner.seq = self.seq
        first = next(n for n in body.graph.nodes if n.op != "placeholder")
        with body.graph.inserting_before(first):
            inner.seq_node, inner.local_len, inner.start = (body.graph.placeholder(name) for name in (
                "sequence_length", "block_length", "block_start"))
        node.args = node.args + (self.seq_node, self.local_len, self.start)
        for placeholder, operand in zip(placeholders, operands):
            if isinstance(operand, Node) and self.layout.get(operand) is not None:
                inner.layout[placeholder] = self.layout[operand]
                inner.traced[placeholder] = self._value(operand)
        self.body_outputs[node] = inner._walk()
        body.graph.eliminate_dead_code()
        body.recompile()
        self.collectives += inner.collectives
        for name, count in inner.whole_ops.items():
            self.whole_ops[name] = self.whole_ops.get(name, 0) + count
        return BODY

    def _finish_outputs(self, output: Node) -> None:
        def full(arg):
            if isinstance(arg, Node) and self.layout.get(arg) is not None:
                return self._gather(output, arg)
            return arg
        output.args = torch.fx.node.map_aggregate(output.args, full)


@dataclass
class SequenceSplit:
    """What :func:`shard_sequence` did to a graph: the collectives it placed; the inputs it cut to the rank's block,
    as (placeholder index, sequence dimension), whose length must divide by the group's size at every call; and the
    ops it ran on the whole sequence (their blocks gathered first), by op."""
    collectives: int = 0
    cut_inputs: List[Tuple[int, int]] = field(default_factory=list)
    whole_ops: Dict[str, int] = field(default_factory=dict)


def shard_sequence(gm: GraphModule, runtime_id: int, size: int, rank: int) -> SequenceSplit:
    """Rewrite ``gm`` for sequence parallelism. No collectives and no inputs cut: the graph has no token ids with a
    dynamic length, and runs as it is, on the full sequence, on every rank."""
    sp = SequencePass(gm, runtime_id, size, rank)
    if not sp.run():
        return SequenceSplit()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    index = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    return SequenceSplit(sp.collectives, [(index[node], dim) for node, dim in sp.seeds], dict(sp.whole_ops))

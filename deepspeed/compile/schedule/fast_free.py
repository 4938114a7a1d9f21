# SPDX-License-Identifier: Apache-2.0
"""``fast_free_schedule``: reorder a ZeRO-3 graph so gathered parameters are released early and gathered late.

The pass works on the forward and backward graphs alike, after the rewrite has placed ``gather_param`` near
the top (where each parameter's placeholder is), ``release_param`` after each last real use and
``reduce_grad`` after each gradient. It computes an order (``compute_fast_free_order``) and a separate step
applies it (``apply_order``). See ``docs/schedule.md`` for the algorithm and why it never raises the peak of
live gathered bytes above the traced order's.

Rules the order keeps:
- every data dependency, and the order of each mutation against the other readers of the mutated storage
  and its aliases (so a release stays after every use of the gathered tensor's views);
- the order of side effects (impure ops, random ops, which draw from the generator in order);
- a deterministic collective order, a function of the graph only (never of ids or hashes): with
  ``collective_order="traced"`` all gathers and reduces keep their traced relative order; with
  ``"first_use"`` gathers are issued in the order of their first use in the schedule and reduces keep
  their traced order among themselves.
"""
import logging
from typing import Dict, List, Optional, Sequence

from torch.fx import Graph, GraphModule, Node

from ..graph.nodes import is_gather, is_reduce, is_release, mutated_inputs, storage_roots, tensor_bytes
from .memory_plan import alias_members, is_collective

logger = logging.getLogger(__name__)

COLLECTIVE_ORDERS = ("traced", "first_use")
_TOP_OPS = ("placeholder", "get_attr")


def frees_memory(node: Node) -> bool:
    """A release or a reduce: run as soon as everything before it has run, since both only free memory."""
    return is_release(node) or is_reduce(node)


def is_side_effect(node: Node) -> bool:
    """Impure or random nodes other than our own ops: they keep their traced relative order."""
    if node.op in ("placeholder", "output", "get_attr") or is_gather(node) or frees_memory(node):
        return False
    if node.op in ("call_module", "call_method"):
        return node.op == "call_module"
    return node.is_impure(impure_random=True)


class GraphFacts:
    """What the scheduler needs to know about a graph, computed once, independent of any order."""

    def __init__(self, nodes: Sequence[Node]):
        self.nodes = list(nodes)
        self.pos = {node: i for i, node in enumerate(self.nodes)}
        self.roots = storage_roots(self.nodes)
        self.members = alias_members(self.nodes, self.roots)
        self.side_effects = [n for n in self.nodes if is_side_effect(n)]
        self.gathers = [n for n in self.nodes if is_gather(n)]
        self.reduces = [n for n in self.nodes if is_reduce(n)]
        self.gather_users = {g: [u for m in self.members[g] for u in m.users] for g in self.gathers}
        self.gather_bytes = {g: tensor_bytes(g) for g in self.gathers}
        self.writes = [(writer, target) for writer in self.nodes for target in mutated_inputs(writer)]
        self.lazy = self._find_lazy()

    def _find_lazy(self) -> Dict[Node, None]:
        """Nodes run only when something needs them: gathers, and pure nodes computed from gathers and other
        lazy nodes alone (views of gathered parameters, constants). Moving them to their first consumer
        never lengthens the life of anything but a gathered parameter, which is live until its release."""
        side_effects = set(self.side_effects)
        lazy: Dict[Node, None] = {}
        for node in self.nodes:
            if is_gather(node) or (node.op == "call_function" and not frees_memory(node) and node not in side_effects
                                   and all(source in lazy for source in node.all_input_nodes)):
                lazy[node] = None
        return lazy

    def peak_gathered(self, order: Sequence[Node]) -> int:
        """Peak of live gathered bytes in ``order``: the same number ``memory_plan`` reports, computed fast."""
        pos = {node: i for i, node in enumerate(order)}
        delta = [0] * (len(order) + 1)
        for gather, users in self.gather_users.items():
            birth = pos[gather]
            delta[birth] += self.gather_bytes[gather]
            delta[max((pos[u] for u in users), default=birth) + 1] -= self.gather_bytes[gather]
        peak = running = 0
        for change in delta:
            running += change
            peak = max(peak, running)
        return peak

    def dependencies(self, gather_order: Optional[Sequence[Node]], collective_order: str) -> Dict[Node, List[Node]]:
        """For each node, the nodes that must run before it, ordered by traced position.

        ``gather_order`` chains the gathers (None: leave gathers unordered among themselves, for the dry
        run that finds first uses). With ``collective_order="traced"`` gathers and reduces form one chain.
        """
        pos, nodes = self.pos, self.nodes
        deps: Dict[Node, List[Node]] = {node: list(node.all_input_nodes) for node in nodes}
        for writer, target in self.writes:
            # Readers of the storage (through any alias) keep their side of the write.
            for member in self.members[self.roots[target]]:
                for reader in member.users:
                    if reader is writer:
                        continue
                    if pos[reader] < pos[writer]:
                        deps[writer].append(reader)
                    else:
                        deps[reader].append(writer)
        _chain(deps, self.side_effects)
        if collective_order == "traced":
            _chain(deps, [n for n in nodes if is_collective(n)])
        else:
            _chain(deps, self.reduces)
            if gather_order is not None:
                _chain(deps, list(gather_order))
        if nodes[-1].op == "output":
            deps[nodes[-1]] = nodes[:-1]
        for node, before in deps.items():
            deps[node] = sorted(set(before), key=pos.__getitem__)
        return deps


def find_lazy_nodes(nodes: Sequence[Node]) -> List[Node]:
    """The nodes the scheduler runs only on demand (see ``GraphFacts``), in graph order."""
    return list(GraphFacts(nodes).lazy)


def _chain(deps: Dict[Node, List[Node]], sequence: Sequence[Node]) -> None:
    for before, after in zip(sequence, sequence[1:]):
        deps[after].append(before)


class _ListScheduler:
    """Demand-driven list scheduling: anchors (the nodes that are neither lazy nor eager) run in traced
    order; each pulls its unscheduled dependencies first, depth first in traced order; eager nodes run as
    soon as they are ready; gathers run when first needed, plus up to ``prefetch`` more in gather order."""

    def __init__(self, facts: GraphFacts, deps: Dict[Node, List[Node]], gather_order: Sequence[Node],
                 prefetch: int):
        self.facts = facts
        self.nodes = facts.nodes
        self.deps = deps
        self.prefetch = prefetch
        self.gather_order = list(gather_order)
        self.gather_pos = {g: i for i, g in enumerate(self.gather_order)}
        self.needed_upto = -1  # highest gather-order position that something has needed so far
        self.order: List[Node] = []
        self.done: Dict[Node, None] = {}
        self.waiting = {n: len(deps[n]) for n in self.nodes if frees_memory(n)}
        self.dependents: Dict[Node, List[Node]] = {n: [] for n in self.nodes}
        for node in self.waiting:
            for before in deps[node]:
                self.dependents[before].append(node)

    def emit(self, node: Node) -> None:
        self.order.append(node)
        self.done[node] = None
        ready = [node]
        while ready:
            for dependent in self.dependents[ready.pop(0)]:
                self.waiting[dependent] -= 1
                if self.waiting[dependent] == 0 and dependent not in self.done:
                    self.order.append(dependent)
                    self.done[dependent] = None
                    ready.append(dependent)

    def need_gather(self, gather: Node) -> None:
        """``gather`` is needed now: keep the gathers up to ``prefetch`` past it issued, where ready."""
        self.needed_upto = max(self.needed_upto, self.gather_pos[gather])
        last = min(self.needed_upto + self.prefetch, len(self.gather_order) - 1)
        for ahead in self.gather_order[self.needed_upto + 1:last + 1]:
            if ahead in self.done:
                continue
            if any(before not in self.done for before in self.deps[ahead]):
                break
            self.emit(ahead)

    def pull(self, target: Node) -> None:
        stack = [(target, iter(self.deps[target]))]
        on_stack = {target}
        while stack:
            node, pending = stack[-1]
            for before in pending:
                if before in self.done:
                    if is_gather(before):
                        self.need_gather(before)
                    continue
                assert before not in on_stack, f"dependency cycle through {before.name}"
                stack.append((before, iter(self.deps[before])))
                on_stack.add(before)
                break
            else:
                stack.pop()
                on_stack.discard(node)
                if node not in self.done:
                    self.emit(node)
                    if is_gather(node):
                        self.need_gather(node)

    def run(self) -> List[Node]:
        lazy = self.facts.lazy
        for node in self.nodes:
            if node.op in _TOP_OPS and node not in self.done:
                self.pull(node)
        for node in self.nodes:
            if node.op not in _TOP_OPS and node not in lazy and not frees_memory(node) and node.op != "output":
                self.pull(node)
        for node in self.nodes:  # whatever nothing needed: dead values, unused gathers
            if node not in self.done and node.op != "output":
                self.pull(node)
        if self.nodes[-1] not in self.done:
            self.pull(self.nodes[-1])
        assert len(self.order) == len(self.nodes), "scheduler lost or duplicated nodes"
        return self.order


def compute_fast_free_order(graph: Graph, *, prefetch: int = 1, collective_order: str = "traced") -> List[Node]:
    """The fast-free order of ``graph``'s nodes (the graph is not changed).

    Tries ``prefetch``, then smaller prefetch depths, and keeps the first order whose peak of live gathered
    bytes is no higher than the traced order's; the traced order itself if none is (never seen, a guard).
    """
    nodes = list(graph.nodes)
    if not any(is_gather(n) or is_reduce(n) for n in nodes):
        return nodes
    facts = GraphFacts(nodes)
    if collective_order == "first_use":
        dry_run = _ListScheduler(facts, facts.dependencies(None, collective_order), facts.gathers, 0).run()
        gather_order = [n for n in dry_run if is_gather(n)]
    else:
        gather_order = facts.gathers
    deps = facts.dependencies(gather_order, collective_order)
    traced_peak = facts.peak_gathered(nodes)
    for depth in range(prefetch, -1, -1):
        order = _ListScheduler(facts, deps, gather_order, depth).run()
        peak = facts.peak_gathered(order)
        if peak <= traced_peak:
            logger.debug("fast_free_schedule: gathered peak %d -> %d bytes (prefetch %d)", traced_peak, peak, depth)
            return order
        logger.info("fast_free_schedule: prefetch %d would raise the gathered peak (%d > %d bytes), trying less",
                    depth, peak, traced_peak)
    logger.warning("fast_free_schedule: no order beats the traced one; keeping the traced order")
    return nodes


def apply_order(gm: GraphModule, order: Sequence[Node]) -> GraphModule:
    """Move ``gm``'s nodes into ``order`` (a permutation of them), then lint and recompile."""
    graph = gm.graph
    current = list(graph.nodes)
    assert len(order) == len(current) and set(order) == set(current), "order must be a permutation of the graph"
    if list(order) != current:
        current[0].prepend(order[0])
        for before, node in zip(order, order[1:]):
            before.append(node)
    graph.lint()
    gm.recompile()
    return gm


def fast_free_schedule(gm: GraphModule, *, prefetch: int = 1, collective_order: str = "traced") -> GraphModule:
    """Reorder ``gm`` so each gathered parameter is released as early as possible and gathered just in time,
    at most ``prefetch`` gathers ahead of need (0: just in time). ``collective_order`` is ``"traced"`` (gathers
    and reduces keep their traced relative order) or ``"first_use"`` (gathers in first-use order; see
    ``docs/schedule.md`` for why backward needs it). Returns ``gm``, reordered in place."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"fast_free_schedule: prefetch must be an integer >= 0, got {prefetch!r}")
    if collective_order not in COLLECTIVE_ORDERS:
        raise ValueError(f"fast_free_schedule: collective_order must be one of {COLLECTIVE_ORDERS}, "
                         f"got {collective_order!r}")
    return apply_order(gm, compute_fast_free_order(gm.graph, prefetch=prefetch, collective_order=collective_order))

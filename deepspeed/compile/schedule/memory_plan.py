# SPDX-License-Identifier: Apache-2.0
"""Static memory plan of a graph in a given node order: what is live at each node, from the graph alone.

Every number here comes from the graph's own tensor metadata (``node.meta["val"]``): no process group, no run.
A *storage* is a tensor that owns memory; views and other aliases share their base's storage and are never
counted twice (the vocabulary of aliases, storage roots and bytes is ``graph/nodes.py``'s). A storage is live from the node that creates it to the last node
that reads it or any of its aliases; a gathered parameter therefore lives from its ``gather_param`` to its
``release_param``. A coalesced run of gathers is live from its first gather, and the receive buffer of the run
started ahead is counted from its start to its copy-out (:func:`in_flight_storages`): the plan bounds what the
runtime really holds, in-flight collectives included. Graph inputs are resident for the whole graph and are
reported apart.
"""
import dataclasses
import logging
import operator
from typing import Dict, List, Optional, Sequence, Tuple, Union

from torch.fx import Graph, GraphModule, Node

from ..graph.nodes import gather_runs, is_gather, is_reduce, is_release, storage_roots, tensor_bytes

logger = logging.getLogger(__name__)

GATHERED = "gathered"
ACTIVATION = "activation"
GRADIENT = "gradient"
INPUT = "input"


GraphLike = Union[GraphModule, Graph, Sequence[Node]]


def is_collective(node: Node) -> bool:
    """Collectives must be issued in the same order on every rank."""
    return is_gather(node) or is_reduce(node)


def nodes_of(graph: GraphLike) -> List[Node]:
    if isinstance(graph, GraphModule):
        return list(graph.graph.nodes)
    if isinstance(graph, Graph):
        return list(graph.nodes)
    return list(graph)


def alias_members(nodes: Sequence[Node], roots: Dict[Node, Node]) -> Dict[Node, List[Node]]:
    """For each storage root, the nodes (itself first, then its aliases in order) that share it."""
    members: Dict[Node, List[Node]] = {}
    for node in nodes:
        members.setdefault(roots[node], []).append(node)
    return members


@dataclasses.dataclass
class Storage:
    """One piece of memory: created at ``birth``, freed after ``death`` (positions in the order)."""
    root: Node
    kind: str
    nbytes: int
    birth: int
    death: int


def find_storages(order: Sequence[Node]) -> List[Storage]:
    """The storages of a graph laid out in ``order`` (a topological order of all its nodes)."""
    pos = {node: i for i, node in enumerate(order)}
    roots = storage_roots(order)
    members = alias_members(order, roots)
    gradient_roots = {roots[n.args[0]] for n in order if is_reduce(n) and isinstance(n.args[0], Node)}
    runs = gather_runs(order)
    run_start = {gather: pos[run[0]] for run in runs for gather in run}
    storages = []
    for root, group in members.items():
        if root.op == "output" or is_release(root) or is_reduce(root):
            continue
        nbytes = tensor_bytes(root)
        if nbytes == 0:
            continue
        birth = pos[root]
        if root.op == "call_function" and root.target is operator.getitem and isinstance(root.args[0], Node):
            birth = pos[root.args[0]]  # an element of a multi-output op exists from that op on
        death = max(max((pos[user] for member in group for user in member.users), default=birth), birth)
        if root.op in ("placeholder", "get_attr"):
            kind, birth, death = INPUT, 0, len(order) - 1  # owned by the caller: resident throughout
        elif is_gather(root):
            kind = GATHERED
            birth = run_start.get(root, birth)  # a coalesced run is gathered whole at its first gather
        elif root in gradient_roots:
            kind = GRADIENT
        else:
            kind = ACTIVATION
        storages.append(Storage(root, kind, nbytes, birth, death))
    storages.extend(in_flight_storages(runs, pos))
    return storages


def in_flight_storages(runs: List[List[Node]], pos: Dict[Node, int]) -> List[Storage]:
    """The receive buffers of coalesced gathers. The runtime starts run k+1's collective when run k is gathered and
    copies its parameters out when run k+1's first gather runs: that buffer is live from run k's first gather to
    run k+1's, where it and the parameters' own copies are live at once. The first run is gathered when it is
    needed (in one collective if it has several members): its buffer is live at its first gather only. The runtime
    copies a run out chunk by chunk (``GatherRuns._start_chunks``), freeing each receive buffer after its copy, so
    what it really holds at that point is the run and one chunk: the plan's whole-run buffer is an upper bound."""
    storages = []
    for k, run in enumerate(runs):
        if k == 0 and len(run) == 1:
            continue  # a lone parameter is gathered by its own op, straight into its buffer
        birth = pos[runs[k - 1][0]] if k else pos[run[0]]
        storages.append(Storage(run[0], GATHERED, sum(tensor_bytes(g) for g in run), birth, pos[run[0]]))
    return storages


@dataclasses.dataclass
class NodeMemory:
    """Live bytes while one node runs, by kind; ``inputs`` (graph inputs) are resident throughout."""
    index: int
    name: str
    gathered: int = 0
    activation: int = 0
    gradient: int = 0
    inputs: int = 0

    @property
    def total(self) -> int:
        """Bytes the graph itself holds at this node (graph inputs excluded)."""
        return self.gathered + self.activation + self.gradient


_FIELD = {GATHERED: "gathered", ACTIVATION: "activation", GRADIENT: "gradient", INPUT: "inputs"}


def memory_plan(graph: GraphLike) -> List[NodeMemory]:
    """Per-node live bytes of ``graph`` in its current order (or of a node sequence, in that order)."""
    order = nodes_of(graph)
    storages = find_storages(order)
    deltas = {kind: [0] * (len(order) + 1) for kind in _FIELD}
    for storage in storages:
        delta = deltas[storage.kind]
        delta[storage.birth] += storage.nbytes
        delta[storage.death + 1] -= storage.nbytes
    plan = []
    running = dict.fromkeys(_FIELD, 0)
    for i, node in enumerate(order):
        record = NodeMemory(i, node.name)
        for kind, field in _FIELD.items():
            running[kind] += deltas[kind][i]
            setattr(record, field, running[kind])
        plan.append(record)
    return plan


def peak_gathered_bytes(graph: GraphLike) -> int:
    """Largest number of gathered-parameter bytes live at any one node."""
    return max((record.gathered for record in memory_plan(graph)), default=0)


def largest_gathered_bytes(graph: GraphLike) -> int:
    """Bytes of the largest single gathered parameter: the unit the scheduler's optimality is stated in."""
    return max((tensor_bytes(n) for n in nodes_of(graph) if is_gather(n)), default=0)


@dataclasses.dataclass
class LowerBound:
    """What some single node needs at once, in every order that respects the graph's data dependencies."""
    gathered_bytes: int
    activation_bytes: int
    node: Optional[str]


def _bits(mask: int) -> List[int]:
    text = bin(mask)[:1:-1]  # least significant bit first
    found, at = [], text.find("1")
    while at != -1:
        found.append(at)
        at = text.find("1", at + 1)
    return found


def _reachability(order: Sequence[Node], pos: Dict[Node, int]) -> Tuple[List[int], List[int]]:
    """Strict ancestor and descendant sets of every node, as bit masks over positions (data edges only)."""
    ancestors = [0] * len(order)
    descendants = [0] * len(order)
    for i, node in enumerate(order):
        mask = 0
        for source in node.all_input_nodes:
            mask |= ancestors[pos[source]] | (1 << pos[source])
        ancestors[i] = mask
    for i in range(len(order) - 1, -1, -1):
        mask = 0
        for user in order[i].users:
            mask |= descendants[pos[user]] | (1 << pos[user])
        descendants[i] = mask
    return ancestors, descendants


def gathered_lower_bound(graph: GraphLike) -> LowerBound:
    """A lower bound on the peak of live gathered bytes that no order of this graph can go under.

    Each parameter is gathered once, so it is live at every node that reads it (or an alias of it) and at
    every node that data dependencies force between two such readers. The bound is the largest total of
    such parameters at one node; ``activation_bytes`` are that node's own non-input tensors (read and made).
    """
    order = nodes_of(graph)
    pos = {node: i for i, node in enumerate(order)}
    roots = storage_roots(order)
    members = alias_members(order, roots)
    sizes = {s.root: s for s in find_storages(order) if s.kind in (ACTIVATION, GRADIENT)}  # a node's own tensors
    ancestors, descendants = _reachability(order, pos)
    need = [0] * len(order)
    for gather in (n for n in order if is_gather(n)):
        readers = {user for member in members[gather] for user in member.users if not is_release(user)}
        if not readers:
            continue
        below = above = own = 0
        for reader in readers:
            below |= descendants[pos[reader]]
            above |= ancestors[pos[reader]]
            own |= 1 << pos[reader]
        for i in _bits((below & above) | own):
            need[i] += tensor_bytes(gather)
    own = [0] * len(order)
    for i, node in enumerate(order):
        touched = {roots[n] for n in node.all_input_nodes} | {roots[node]}
        own[i] = sum(sizes[r].nbytes for r in touched if r in sizes)
    best = max(range(len(order)), key=lambda i: (need[i], own[i]), default=None)
    if best is None or need[best] == 0:
        return LowerBound(0, 0, None)
    return LowerBound(need[best], own[best], order[best].name)

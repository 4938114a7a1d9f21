# SPDX-License-Identifier: Apache-2.0
"""Tag pass: before partitioning, mark every parameter alias and downcast ``MUST_RECOMPUTE``.

With these tags the min-cut partitioner can never save a gathered parameter, a view of it, or its autocast
copy for backward: backward recomputes them from the parameter input (a storage-less stand-in), which the
rewrite then turns into a fresh gather, with the downcast folded in. The parameters chosen to stay gathered from
forward to backward (``compile.keep_gathered_bytes``: by DeepSpeed's ``stage3_max_reuse_distance``, as eager ZeRO-3
chooses, or by a byte budget) are left untagged: the partitioner may save them.
"""
import bisect
from typing import AbstractSet, Dict, Iterable, List, Set, Tuple

from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from .nodes import META_DS_ID, derived_closure, is_gather, is_release, param_primals, placeholders, size_hint

RECOMPUTE = "recompute"


def tag_param_aliases_pass(gm: GraphModule, *, keep: AbstractSet[int] = frozenset()) -> GraphModule:
    """Mark each node reached from a parameter primal only through gathers, aliases and downcasts, except for the
    parameters whose ds_id is in ``keep``: the partitioner may save those gathered for backward (see
    ``choose_kept_params``)."""
    primals = [n for n in param_primals(gm.graph) if n.meta[META_DS_ID] not in keep]
    for node in derived_closure(primals):
        if node.op == "call_function":
            node.meta[RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
    return gm


def _first_gathers(gm: GraphModule) -> Dict[int, Tuple[int, Node]]:
    """ds_id -> (graph position, node) of its first gather whose value is known, in graph order."""
    found: Dict[int, Tuple[int, Node]] = {}
    for index, node in enumerate(gm.graph.nodes):
        if is_gather(node) and node.args[2] not in found and node.meta.get("val") is not None:
            found[node.args[2]] = (index, node)
    return found


def _gathered_bytes(node: Node) -> int:
    val = node.meta["val"]
    return size_hint(val.numel()) * val.element_size()


def choose_kept_params(gm: GraphModule, budget_bytes: int) -> Dict[int, int]:
    """Parameters of a joint graph to keep gathered from forward to backward, within ``budget_bytes``: the last
    gathered in forward first, since backward needs them first (they stay gathered the shortest time). Sizes are the
    gathered parameter in its own dtype (an upper bound when autocast saves a narrower copy)."""
    gathers = _first_gathers(gm)
    kept: Dict[int, int] = {}  # ds_id -> bytes
    for ds_id in sorted(gathers, key=lambda i: gathers[i][0], reverse=True):
        size = _gathered_bytes(gathers[ds_id][1])
        if size <= budget_bytes:
            kept[ds_id] = size
            budget_bytes -= size
    return kept


def reuse_distances(gm: GraphModule, outside_numel: int = 0) -> Dict[int, int]:
    """For each parameter of a joint graph that backward reads: its forward-to-backward reuse distance as eager
    ZeRO-3 measures it for ``stage3_max_reuse_distance``, the elements of the parameters used between its last
    forward read and its first backward read, each counted once per direction it is used in there
    (``partitioned_param_coordinator``'s walk over the modules between the two uses). ``outside_numel``: elements of
    parameters outside this graph, counted twice (once per direction) for every parameter: an upper bound, since
    the graph does not know where its run falls among the others'."""
    return {ds_id: reuse for ds_id, (reuse, _) in _distances(gm, _first_gathers(gm), outside_numel).items()}


def _distances(gm: GraphModule, gathers: Dict[int, Tuple[int, Node]],
               outside_numel: int) -> Dict[int, Tuple[int, int]]:
    """ds_id -> (reuse distance, as ``reuse_distances``; the elements of the other parameters used between the two
    reads, each counted once: what eager ZeRO-3's prefetcher must gather before it reaches the backward read)."""
    position = {node: index for index, node in enumerate(gm.graph.nodes)}
    backward = set(dependents(n for n in placeholders(gm.graph) if "tangents" in n.name))
    reads: Dict[int, Tuple[List[int], List[int]]] = {}  # ds_id -> sorted (forward, backward) read positions
    for ds_id, (_, gather) in gathers.items():
        closure = derived_closure([gather])
        readers = {u for n in closure for u in n.users if u not in closure and not is_release(u) and u.op != "output"}
        reads[ds_id] = (sorted(position[r] for r in readers if r not in backward),
                        sorted(position[r] for r in readers if r in backward))
    numel = {ds_id: size_hint(node.meta["val"].numel()) for ds_id, (_, node) in gathers.items()}

    def read_between(positions: List[int], start: int, end: int) -> bool:
        i = bisect.bisect_right(positions, start)
        return i < len(positions) and positions[i] < end

    distances: Dict[int, Tuple[int, int]] = {}
    for ds_id, (forward, backward_reads) in reads.items():
        if not backward_reads:
            continue
        start, end = (forward[-1] if forward else gathers[ds_id][0]), backward_reads[0]
        reuse = window = 2 * outside_numel
        for other, (f, b) in reads.items():
            if other != ds_id:
                in_forward, in_backward = read_between(f, start, end), read_between(b, start, end)
                reuse += numel[other] * (in_forward + in_backward)
                window += numel[other] * (in_forward or in_backward)
        distances[ds_id] = (reuse, window)
    return distances


def choose_kept_by_reuse(gm: GraphModule, max_reuse_distance: int, outside_numel: int = 0,
                         prefetch_window: int = 0) -> Dict[int, int]:
    """Parameters of a joint graph to keep gathered from forward to backward as eager ZeRO-3 keeps them, ds_id ->
    gathered bytes. Eager ZeRO-3 keeps a parameter for either of two reasons:

    - its reuse distance (``reuse_distances``) is under DeepSpeed's ``stage3_max_reuse_distance``. With its
      default (1e9 elements) that is every parameter backward reads.
    - its prefetcher already passed the backward read when the forward use ends: the prefetcher walks the trace
      ahead of the current module, gathering what it finds not gathered (up to ``stage3_prefetch_bucket_size``
      elements per module, while at most ``stage3_max_live_parameters`` are gathered: ``prefetch_window``), and
      marks a parameter it finds still gathered as wanted there, so the release after forward skips it. So it keeps
      the parameters whose backward read comes within that many elements of gathering, the parameter itself and
      each other parameter used in between counted once, even at a reuse distance of 0: those at the end of forward
      and the start of backward (the head, the last blocks). The nearest first, and no more than the window in all
      (what it holds gathered when forward ends is bounded by it).
    """
    gathers = _first_gathers(gm)
    distances = _distances(gm, gathers, outside_numel)
    kept = {ds_id for ds_id, (reuse, _) in distances.items() if reuse < max_reuse_distance}
    room = prefetch_window
    for ds_id in sorted(distances, key=lambda i: distances[i][1]):
        numel = size_hint(gathers[ds_id][1].meta["val"].numel())
        if ds_id not in kept and distances[ds_id][1] + numel <= prefetch_window and numel <= room:
            kept.add(ds_id)
            room -= numel
    return {ds_id: _gathered_bytes(gathers[ds_id][1]) for ds_id in kept}


def dependents(roots: Iterable[Node]) -> Set[Node]:
    """Every node that depends on one of ``roots`` (in a joint graph, from the tangents: backward's nodes)."""
    found: Set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(node.users)
    return found

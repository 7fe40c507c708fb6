"""PipeDream's own optimizer terms (``optimizer/optimizer_graph_hierarchical.py``).

``--cost-model pipedream`` reproduces the figures PipeDream's optimizer
prints, term for term, so that dreampipe's plans can be compared with the
paper's. Its terms differ from dreampipe's (:mod:`dreampipe.planning.costs`):
the all-reduce is added to compute rather than overlapped, and a cut is
charged on the stage after it. It plans over PipeDream's *states*, the
downward-closed node sets of its antichain DAG, which on a chain are the
layers. The terms and the states: docs/design.md §6.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dreampipe.planning.costs import FloatArray, RangeCosts
from dreampipe.profiling.graph import LayerGraph

__all__ = [
    "PipeDreamStates",
    "pipedream_allreduce_time",
    "pipedream_dp_time",
    "pipedream_stage_time",
    "pipedream_stage_times",
    "pipedream_states",
    "pipedream_transfer_time",
]


def pipedream_allreduce_time(
    weight_bytes: FloatArray | float, replicas: int, bandwidth: float, server_workers: int = 1
) -> FloatArray:
    """PipeDream's data-parallel term: ``4(m-1)/m * |w| / B``, divided by ``server_workers``.

    Its optimizer charges twice a ring all-reduce; on an outer level it divides
    the term by the workers inside one unit below, which share the traffic.
    """
    w = np.asarray(weight_bytes, dtype=np.float64)
    return np.asarray(4.0 * (replicas - 1) * w / (bandwidth * replicas) / server_workers)


def pipedream_stage_time(
    inner_s: FloatArray | float,
    weight_bytes: FloatArray | float,
    replicas: int,
    bandwidth: float,
    server_workers: int = 1,
) -> FloatArray:
    """PipeDream's stage time: ``(inner + all-reduce) / m``, the terms *added*, not overlapped."""
    inner = np.asarray(inner_s, dtype=np.float64)
    sync = pipedream_allreduce_time(weight_bytes, replicas, bandwidth, server_workers)
    return np.asarray((inner + sync) / replicas)


def pipedream_transfer_time(
    out_bytes: FloatArray | float, replicas: int, bandwidth: float
) -> FloatArray:
    """PipeDream's cut term ``2a / (B m')``: the transfer is shared by the ``m'`` replicas after it.

    It bounds the pipeline (a max), charged on the input and the output of
    every stage after a cut, at the bandwidth of the level that cuts.
    """
    return np.asarray(2.0 * np.asarray(out_bytes, dtype=np.float64) / (bandwidth * replicas))


def pipedream_dp_time(
    compute_s: float, weight_bytes: float, levels: Sequence[tuple[int, float]]
) -> float:
    """Data parallelism on every worker, per minibatch: the stage term applied level by level.

    ``levels`` are ``(units, bandwidth)`` innermost first; each level divides
    its all-reduce by the unit count of the level below, as PipeDream does.
    """
    t, below = compute_s, 1
    for count, bandwidth in levels:
        t = float(pipedream_stage_time(t, weight_bytes, count, bandwidth, below))
        below = count
    return t


@dataclass(frozen=True)
class PipeDreamStates:
    """PipeDream's states as a chain for the DP: range costs, cut rule and layer ends.

    ``costs.stage_ok[s, e]`` is the cut rule and ``costs.cut_bytes[k]`` the
    output of state ``k`` (the DP's own cut term is zero under this model,
    :func:`pipedream_transfer_time` charges it); ``last_layer[j]`` the highest
    layer index (in the graph's order) inside state ``j``, used to show a plan
    over states as layer ranges (exact on chains).
    """

    costs: RangeCosts
    last_layer: tuple[int, ...]


def _kept_nodes(graph: LayerGraph) -> list[int]:
    """Layers PipeDream plans over: without ``Input`` sources, then unused ``__getitem__`` sinks."""
    n = len(graph.layers)
    has_in = {d for _, d in graph.edges}
    gone = {i for i, x in enumerate(graph.layers)
            if i not in has_in and x.description.startswith("Input")}
    out_after = {s for s, d in graph.edges if s not in gone and d not in gone}
    gone |= {i for i in range(n) if i not in gone and i not in out_after
             and graph.layers[i].description.startswith("__getitem__")}
    return [i for i in range(n) if i not in gone]


def _ideals(graph: LayerGraph, kept: list[int]) -> tuple[list[int], list[int]]:
    """Reachable ideals (bitsets of layers) in a topological order, and their ancestor sets.

    From the first source's ideal, a state ``I`` leads to ``I | ideal(v)``
    for each node ``v`` outside ``I`` with a parent in it (PipeDream's
    ``next_antichains``). Ancestors are bitsets over state indices.
    """
    keep = set(kept)
    parents: dict[int, list[int]] = {v: [] for v in kept}
    for s, d in graph.edges:
        if s in keep and d in keep:
            parents[d].append(s)
    closure: dict[int, int] = {}
    for v in kept:  # graph order is topological
        bits = 1 << v
        for p in parents[v]:
            bits |= closure[p]
        closure[v] = bits
    start = closure[next(v for v in kept if not parents[v])]
    preds: dict[int, set[int]] = {start: set()}
    queue = [start]
    while queue:
        ideal = queue.pop(0)
        for v in kept:
            if not ideal >> v & 1 and any(ideal >> p & 1 for p in parents[v]):
                nxt = ideal | closure[v]
                if nxt not in preds:
                    preds[nxt] = set()
                    queue.append(nxt)
                preds[nxt].add(ideal)
    order = sorted(preds, key=lambda b: (b.bit_count(), b))
    index = {b: i for i, b in enumerate(order)}
    anc: list[int] = []
    for b in order:
        bits = 0
        for p in preds[b]:
            bits |= anc[index[p]] | 1 << index[p]
        anc.append(bits)
    return order, anc


def _outputs(graph: LayerGraph, kept: list[int], order: list[int]) -> list[float]:
    """Bytes of each state's augmented antichain (PipeDream's ``output_activation_size``)."""
    keep = set(kept)
    children: dict[int, list[int]] = {v: [] for v in kept}
    parents: dict[int, list[int]] = {v: [] for v in kept}
    for s, d in graph.edges:
        if s in keep and d in keep:
            children[s].append(d)
            parents[d].append(s)
    closure: dict[int, int] = {}
    for v in kept:
        closure[v] = (1 << v) | _union(closure[p] for p in parents[v])
    out = []
    for ideal in order:
        tops = [v for v in kept if ideal >> v & 1 and not any(ideal >> c & 1 for c in children[v])]
        aug = set(tops)
        for a in tops:
            below = closure[a] & ~(1 << a)
            aug |= {p for p in kept if below >> p & 1
                    and any(not closure[a] >> c & 1 for c in children[p])}
        out.append(float(sum(graph.layers[v].activation_bytes for v in aug)))
    return out


def _union(parts: Iterable[int]) -> int:
    """Union of bitsets."""
    bits = 0
    for b in parts:
        bits |= b
    return bits


def pipedream_states(graph: LayerGraph) -> PipeDreamStates:
    """PipeDream's planning input for ``graph``: range sums over its states and the cut rule."""
    kept = _kept_nodes(graph)
    order, anc = _ideals(graph, kept)
    members = [[v for v in kept if b >> v & 1] for b in order]

    def table(values: list[float], empty: float) -> FloatArray:
        prefix = np.array([0.0, *(sum(values[v] for v in m) for m in members)])
        t = prefix[None, 1:] - prefix[:-1, None]
        return np.where(np.triu(np.ones((len(order),) * 2, dtype=bool)), t, empty)

    layers = graph.layers
    s = len(order)
    ok = np.zeros((s, s), dtype=bool)
    ok[0, :] = True
    for e in range(s):
        for start in range(1, e + 1):
            ok[start, e] = bool(anc[e] >> (start - 1) & 1)
    costs = RangeCosts(
        table([x.compute_ms / 1e3 for x in layers], np.inf),
        table([float(x.parameter_bytes) for x in layers], 0.0),
        table([float(x.activation_bytes) for x in layers], 0.0),
        np.asarray(_outputs(graph, kept, order)),
        ok,
    )
    return PipeDreamStates(costs, tuple(max(m) for m in members))


def pipedream_stage_times(
    prof: RangeCosts, inner_time: FloatArray, slots: int, max_units: int, bandwidth: float,
    below: int,
) -> tuple[dict[tuple[int, int], FloatArray], dict[tuple[int, int], FloatArray]]:
    """PipeDream's stage times ``[(slot, m)] -> [1, i, j]`` (its one context): after a cut,
    and first of a whole level's range (its all-reduce shared by the ``below`` units of a
    server)."""
    after, first = {}, {}
    n = prof.n
    before = np.concatenate([[0.0], prof.cut_bytes[:-1]])[:, None]  # out(s - 1)
    after_out = np.where(np.arange(n) < n - 1, prof.cut_bytes, 0.0)[None, :]  # out(e)
    for q in range(slots):
        for m in range(1, max_units + 1):
            t = np.maximum(pipedream_stage_time(inner_time[q], prof.weights, m, bandwidth),
                           pipedream_transfer_time(np.maximum(before, after_out), m, bandwidth))
            first[q, m] = pipedream_stage_time(inner_time[q], prof.weights, m, bandwidth,
                                               below)[None]
            after[q, m] = (t if prof.stage_ok is None else np.where(prof.stage_ok, t, np.inf))[None]
    return after, first

"""The operator search: the fastest split of every layer of a chain over ``t`` workers.

Tofu coarsens the graph, then runs a dynamic program over the coarsened
chain for the splits that move the fewest bytes. dreampipe does the same
with two changes: the objective is time (compute share plus collectives,
not hidden), so replication and batch splits compete with tensor splits
(Tofu's "worse than data parallelism for small models" cannot happen: all
batch is one of the candidates), and a memory limit per worker is honoured
exactly, by keeping for each layout every (time, memory) pair no other pair
beats on both.

Coarsening groups each layer with the elementwise layers after it::

    Linear  ReLU  Dropout | Linear  GELU | LayerNorm | Linear
    '---- group 0 ------'  '-- group 1 -' '-group 2-' '-group 3-'

A group runs its head under one :class:`~dreampipe.planning.splits.Split`
and its elementwise tail in one layout (a partial sum is reduced first).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

from dreampipe.errors import PlanError
from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.memory_terms import STATELESS, OptimizerTerms, memory_bytes
from dreampipe.planning.splits import (
    Collective,
    Layout,
    OpKind,
    Split,
    SplitCost,
    layer_splits,
    op_kind,
    reshard,
    split_cost,
)
from dreampipe.profiling.graph import Layer, LayerGraph

__all__ = ["Link", "SplitPlan", "coarsen", "cost_seconds", "layer_costs", "search_splits",
           "split_front", "split_memory"]

_TAIL_LAYOUTS = {Layout.REPLICATED: Split.REPLICA, Layout.BATCH: Split.BATCH,
                 Layout.FEATURE: Split.OUT}
_SOURCES = (Layout.REPLICATED, Layout.BATCH)  # data loads whole or by batch share, for free


@dataclass(frozen=True)
class Link:
    """The workers' interconnect: bytes/s and seconds per message round."""

    bandwidth: float
    latency_s: float = 0.0

    def seconds(self, collective: Collective | None, size: float, t: int) -> float:
        """A ring ``collective`` of a ``size``-byte tensor over ``t`` workers."""
        if collective is None or t <= 1 or size <= 0:
            return 0.0
        return collective.steps(t) * self.latency_s + collective.wire_fraction(t) * size / (
            self.bandwidth)


@dataclass(frozen=True)
class SplitPlan:
    """The chosen split of every layer, with its time and memory per worker.

    ``time_s`` is compute plus collectives per minibatch; ``memory_bytes``
    weights, gradients and stashed outputs per worker; ``comm_s`` the
    collectives' share of the time.
    """

    workers: int
    splits: tuple[Split, ...]
    layouts: tuple[Layout, ...]
    time_s: float
    comm_s: float
    memory_bytes: float


@dataclass(frozen=True)
class _Point:
    """A way to run the chain so far: its totals, and the splits and layouts of its last
    group after those of ``before`` (a shared trail, not a copy per point)."""

    time: float
    comm: float
    memory: float
    splits: tuple[Split, ...]
    layouts: tuple[Layout, ...]
    before: _Point | None = None

    def plan(self, workers: int) -> SplitPlan:
        """The :class:`SplitPlan` of the whole trail."""
        trail: list[_Point] = []
        at: _Point | None = self
        while at is not None:
            trail.append(at)
            at = at.before
        trail.reverse()
        return SplitPlan(workers, tuple(x for p in trail for x in p.splits),
                         tuple(x for p in trail for x in p.layouts), self.time, self.comm,
                         self.memory)


def coarsen(graph: LayerGraph) -> list[list[int]]:
    """Layer indices grouped: each layer that is not elementwise starts a group, and
    the elementwise layers after it join it (leading ones form their own group)."""
    _require_chain(graph)
    groups: list[list[int]] = []
    for i, layer in enumerate(graph.layers):
        if op_kind(layer) is OpKind.ELEMENTWISE and groups:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def layer_costs(layer: Layer, split: Split, t: int, link: Link,
                input_bytes: float, optimizer: OptimizerTerms = STATELESS
                ) -> tuple[float, float, float]:
    """``(seconds, collective seconds, bytes per worker)`` of one layer under ``split``: its
    weights, their gradient, what ``optimizer`` holds per byte of a layer
    (:attr:`~.memory_terms.OptimizerTerms.per_layer`) and what the layer keeps."""
    c = split_cost(layer, op_kind(layer), split, t, input_bytes)
    seconds, comm = cost_seconds(c, t, link)
    return seconds, comm, (2 + optimizer.per_layer) * c.weight_bytes + c.activation_bytes


def cost_seconds(c: SplitCost, t: int, link: Link) -> tuple[float, float]:
    """``(seconds, collective seconds)`` of a layer whose split costs ``c`` (its compute and
    its own collectives over ``t`` workers on ``link``): :func:`layer_costs`' times."""
    comm = sum(link.seconds(what, size, t) for what, size in c.collectives)
    return c.compute_ms / 1e3 + comm, comm


def search_splits(graph: LayerGraph, workers: int, link: Link,
                  memory_bytes: float | None = None, optimizer: OptimizerTerms = STATELESS
                  ) -> SplitPlan:
    """The fastest split of ``graph`` (a chain) over ``workers`` that fits ``memory_bytes``
    beside what ``optimizer`` holds per byte of a layer (a stage's check adds its largest
    layer's step temporaries, :func:`~.split_stage.best_split`).

    Exact over the coarsened chain: the dynamic program keeps, per layout of
    the activation between groups, every (time, memory) pair not beaten on
    both, so the memory limit costs no optimality. A partial sum left at the
    end is all-reduced for the loss.
    """
    if workers < 1:
        raise PlanError(f"workers={workers}; split over at least 1 worker")
    limit = math.inf if memory_bytes is None else memory_bytes
    finals = _finals(graph, workers, link, limit, optimizer)
    if not finals:
        smallest = min(p.memory for p in _finals(graph, workers, link, math.inf, optimizer))
        raise PlanError(
            f"no split of {graph.model or 'the model'} over {workers} workers fits "
            f"{limit:.4g} bytes per worker; the smallest needs {smallest:.4g}: add workers "
            "or memory"
        )
    return min(finals, key=lambda p: (p.time, p.memory)).plan(workers)


def split_front(graph: LayerGraph, workers: int, link: Link,
                optimizer: OptimizerTerms = STATELESS) -> tuple[SplitPlan, SplitPlan]:
    """The two ends of the search's (time, memory) front over ``workers``: the fastest
    split of ``graph`` (:func:`search_splits` without a limit) and the one that holds the
    least per worker (ties: the faster), beside what ``optimizer`` holds per layer."""
    fastest, leanest = _ends(graph, workers, link, optimizer)
    return fastest.plan(workers), leanest.plan(workers)


def _ends(graph: LayerGraph, t: int, link: Link, optimizer: OptimizerTerms
          ) -> tuple[_Point, _Point]:
    """The least of :func:`_finals` by (time, memory) and by (memory, time), without the
    whole front: in a lexicographic order of sums a few points a layout suffice (adding
    the same costs keeps the order), those whose first term ties the least's within
    rounding (:func:`_near_least`), which later sums may turn into exact ties."""
    keys: tuple[Callable[[_Point], tuple[float, float]], ...] = (
        lambda p: (p.time, p.memory), lambda p: (p.memory, p.time))
    layers = graph.layers
    start = {lay: [_Point(0.0, 0.0, 0.0, (), ())] for lay in _SOURCES}
    fronts: list[dict[Layout, list[_Point]]] = [dict(start), dict(start)]
    seen: dict[tuple[int, Layout], list[tuple[Layout, _Point]]] = {}
    kinds: dict[tuple[object, ...], int] = {}  # each group's kind, hashed once a group
    for group in coarsen(graph):  # a profile by shape repeats its blocks: price each once
        alike = kinds.setdefault((tuple(_shape(layers[i]) for i in group),
                                  _input_bytes(layers, group[0])), len(kinds))
        options = {}
        for src in set(fronts[0]) | set(fronts[1]):
            if (alike, src) not in seen:
                seen[alike, src] = _group_options(layers, group, src, t, link, optimizer)
            options[src] = seen[alike, src]
        for k, key in enumerate(keys):
            grown: dict[Layout, list[_Point]] = {}
            for src, points in fronts[k].items():
                for out, extra in options[src]:
                    grown.setdefault(out, []).extend(
                        _Point(p.time + extra.time, p.comm + extra.comm,
                               p.memory + extra.memory, extra.splits, extra.layouts, p)
                        for p in points)
            fronts[k] = {lay: _near_least(points, key) for lay, points in grown.items()}
    reduce = link.seconds(Collective.ALL_REDUCE, float(layers[-1].activation_bytes), t)
    ends = [min((p if lay is not Layout.PARTIAL else
                 _Point(p.time + reduce, p.comm + reduce, p.memory, (), (), p)
                 for lay, points in front.items() for p in points), key=key)
            for front, key in zip(fronts, keys, strict=True)]
    return ends[0], ends[1]


#: Relative rounding of a sum of costs: two sums this close may be equal when added up
#: in another order.
_ROUNDING = 1e-9


def _near_least(points: list[_Point], key: Callable[[_Point], tuple[float, float]]
                ) -> list[_Point]:
    """The points of the (time, memory) front (:func:`_pareto`, the same whichever term
    leads) whose first term of ``key`` is within :data:`_ROUNDING` of the least."""
    front = _pareto(points)
    least = min(key(p)[0] for p in front)
    return [p for p in front if key(p)[0] <= least + _ROUNDING * abs(least)]


def _finals(graph: LayerGraph, t: int, link: Link, limit: float, optimizer: OptimizerTerms
            ) -> list[_Point]:
    """Every (time, memory)-optimal way to run the whole chain within ``limit``."""
    layers = graph.layers
    frontier: dict[Layout, list[_Point]] = {lay: [_Point(0.0, 0.0, 0.0, (), ())]
                                            for lay in _SOURCES}
    for group in coarsen(graph):
        grown: dict[Layout, list[_Point]] = {}
        for src, points in frontier.items():
            for out, extra in _group_options(layers, group, src, t, link, optimizer):
                into = grown.setdefault(out, [])
                for p in points:
                    if p.memory + extra.memory <= limit:
                        into.append(_Point(p.time + extra.time, p.comm + extra.comm,
                                           p.memory + extra.memory, extra.splits,
                                           extra.layouts, p))
        frontier = {lay: _pareto(pts) for lay, pts in grown.items() if pts}
    reduce = link.seconds(Collective.ALL_REDUCE, float(layers[-1].activation_bytes), t)
    return [p if lay is not Layout.PARTIAL else
            _Point(p.time + reduce, p.comm + reduce, p.memory, (), (), p)
            for lay, pts in frontier.items() for p in pts]


def _group_options(
    layers: tuple[Layer, ...], group: list[int], src: Layout, t: int, link: Link,
    optimizer: OptimizerTerms,
) -> list[tuple[Layout, _Point]]:
    """Each way to run ``group`` from an input in ``src``: its output layout and costs."""
    head, tail = layers[group[0]], [layers[i] for i in group[1:]]
    options: list[tuple[Layout, _Point]] = []
    size = _input_bytes(layers, group[0])
    for split in layer_splits(head, t):
        c = split_cost(head, op_kind(head), split, t, size)
        time, comm, memory = layer_costs(head, split, t, link, size, optimizer)
        move = _reshard_seconds(src, c.needs, size, t, link)
        base = _Point(time + move, comm + move, memory, (split,), (c.gives,))
        if not tail:
            options.append((c.gives, base))
            continue
        for lay, tail_split in _TAIL_LAYOUTS.items():
            reduce = _reshard_seconds(c.gives, lay, float(head.activation_bytes), t, link)
            costs = [layer_costs(x, tail_split, t, link, float(head.activation_bytes),
                                 optimizer) for x in tail]
            options.append((lay, _Point(
                base.time + reduce + sum(x[0] for x in costs),
                base.comm + reduce + sum(x[1] for x in costs),
                base.memory + sum(x[2] for x in costs),
                base.splits + (tail_split,) * len(tail),
                base.layouts + (lay,) * len(tail),
            )))
    return options


def split_memory(
    graph: LayerGraph, first: int, last: int, splits: tuple[Split, ...], t: int,
    versions: int, in_flight: int, *, optimizer_copies: float = 0.0, stash: bool = True,
    recompute: bool = False, step_bytes: float = 0.0,
) -> int:
    """Bytes per worker of a stage of layers ``first..last`` split over ``t`` workers.

    :func:`~dreampipe.planning.memory_terms.memory_bytes` with each layer's weights
    and kept tensors at its split's share; the stage's input, its sends and
    the backward's working space are whole (a split stage reads and returns
    replicated tensors), and so is the copy of its input it runs on where its first layer
    writes it; ``recompute`` keeps one microbatch's kept tensors only.
    """
    costs = RangeCosts.of(graph)
    weights, kept = 0.0, float(costs.copies[first])
    for i, split in zip(range(first, last + 1), splits, strict=True):
        layer = graph.layers[i]
        c = split_cost(layer, op_kind(layer), split, t, _input_bytes(graph.layers, i))
        weights += c.weight_bytes
        share = c.activation_bytes / layer.activation_bytes if layer.activation_bytes else 1.0
        kept += layer.stash_bytes * share
    return round(float(memory_bytes(
        weights, kept, versions, in_flight, input_bytes=costs.inputs[first, last],
        sent_bytes=costs.sent[first, last], working_bytes=costs.backward_working[first, last],
        optimizer_copies=optimizer_copies, stash=stash, recompute=recompute,
        step_bytes=step_bytes,
    )))


def _reshard_seconds(src: Layout, dst: Layout, size: float, t: int, link: Link) -> float:
    forward, backward = reshard(src, dst)
    return link.seconds(forward, size, t) + link.seconds(backward, size, t)


#: Every field of a layer but its name: what its costs read.
_SHAPE_FIELDS = tuple(f.name for f in fields(Layer) if f.name != "name")


def _shape(layer: Layer) -> tuple[object, ...]:
    """``layer`` but its name: layers alike but for it cost the same."""
    return tuple(getattr(layer, f) for f in _SHAPE_FIELDS)


def _input_bytes(layers: tuple[Layer, ...], index: int) -> float:
    """The bytes of layer ``index``'s input: the previous layer's output (the first
    layer's own output size stands in for the data it reads)."""
    return float(layers[max(index - 1, 0)].activation_bytes)


def _pareto(points: list[_Point]) -> list[_Point]:
    """The points no other point beats in both time and memory (ties: the first kept)."""
    kept: list[_Point] = []
    best_memory = math.inf
    for p in sorted(points, key=lambda q: (q.time, q.memory)):
        if p.memory < best_memory:
            kept.append(p)
            best_memory = p.memory
    return kept


def _require_chain(graph: LayerGraph) -> None:
    chain = {(i, i + 1) for i in range(len(graph) - 1)}
    if set(graph.edges) != chain:
        raise PlanError(
            f"operator search needs a chain of layers; {graph.model or 'this model'} has "
            f"{len(graph.edges)} edges that are not one layer after another"
        )

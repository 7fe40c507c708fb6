"""Tensor splits as a per-stage choice: what any layer range costs split over ``t`` workers.

The range program (:mod:`dreampipe.planning.ranges`) may run a stage as
``r`` replicas, each split over ``t`` workers of one server (config token
``2t4``). A :class:`StageSplit` fixes how every layer is split over ``t`` (an
answer of :mod:`dreampipe.planning.operator_search`) and holds, as a
:class:`~dreampipe.planning.costs.RangeCosts`, what a stage of layers ``i..j``
run that way costs one replica, reshards at its edges included. Every term
the range program and the pricing read is then the same look-up as for an
unsplit stage, so splitting adds options without new pricing rules.
:func:`split_options` gives the two splits per ``t`` the planner tries, the
two ends of the operator search's (time, memory) front (docs/design.md §10.3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dreampipe.planning.costs import FloatArray, RangeCosts
from dreampipe.planning.held import held_table
from dreampipe.planning.memory_terms import STATELESS, OptimizerTerms, input_copies
from dreampipe.planning.operator_search import Link, cost_seconds, split_front
from dreampipe.planning.splits import (
    Collective,
    Layout,
    Split,
    SplitCost,
    op_kind,
    reshard,
    split_cost,
)
from dreampipe.planning.sync_bands import pick
from dreampipe.planning.topology import Topology
from dreampipe.planning.triangle import upper
from dreampipe.profiling.graph import LayerGraph

__all__ = ["StageSplit", "fits_servers", "split_costs", "split_latencies", "split_options"]

IntArray = npt.NDArray[np.int64]
#: Every range of a table, as an index.
_ALL = slice(None)
#: Each layer's time inside a stage, its forward's compute and own collectives, and the
#: layouts it needs and gives (:func:`_layer_times`).
_LayerTimes = tuple[FloatArray, FloatArray, FloatArray, list[Layout], list[Layout]]


@dataclass(frozen=True, eq=False)
class StageSplit:
    """Every layer of a model split as ``splits`` over ``t`` workers of one server, and
    what a stage of any layer range costs one replica so (``costs``, docs/design.md §10.3);
    ``latencies``: the part of its times that its collectives' message latencies make;
    ``own``: each layer's time inside a stage, its own collectives included but not the
    reshards around it, and that time's latencies (a stage takes at least its layers')."""

    t: int
    splits: tuple[Split, ...]
    costs: RangeCosts
    latencies: tuple[FloatArray, FloatArray] | None = None
    own: tuple[FloatArray, FloatArray] | None = None

    def at_fraction(self, fraction: float, rows: IntArray | slice = _ALL,
                    last: IntArray | slice = _ALL) -> tuple[FloatArray, FloatArray]:
        """``(compute, forward)`` of a microbatch ``fraction`` of the profiled one, of the
        stages ``rows..last`` (index arrays of one shape; every range by default): the
        times scale, their collectives' message latencies (``latencies``) do not."""
        c = self.costs

        def at(table: FloatArray) -> FloatArray:
            if isinstance(rows, slice) or isinstance(last, slice):
                return table[rows, last]
            return pick(table, rows, last)

        if self.latencies is None:
            return at(c.compute_s) * fraction, at(c.forward) * fraction
        fixed, fixed_forward = (at(x) for x in self.latencies)
        return ((at(c.compute_s) - fixed) * fraction + fixed,
                (at(c.forward) - fixed_forward) * fraction + fixed_forward)

    def layers(self, first: int, last: int) -> tuple[Split, ...]:
        """The splits of a stage of layers ``first..last``."""
        return self.splits[first:last + 1]


def _moves(src: Layout, dst: Layout, size: float, t: int, link: Link,
           forward_only: bool = False) -> float:
    forward, backward = reshard(src, dst)
    there = link.seconds(forward, size, t)
    return there if forward_only else there + link.seconds(backward, size, t)


def _own_forward(split: Split, collectives: Sequence[tuple[Collective, float]], t: int,
                 link: Link) -> float:
    """The seconds of a layer's own collectives that its forward runs: an input split's
    reduction of its sum; a batch split's weight gradient and an output split's input
    gradient are the backward's."""
    if split is not Split.IN:
        return 0.0
    return sum(link.seconds(what, size, t) for what, size in collectives)


def _sums(values: FloatArray, empty: float) -> FloatArray:
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    n = len(values)
    return np.where(upper(n), prefix[None, 1:] - prefix[:-1, None],
                    empty)


def split_costs(graph: LayerGraph, t: int, link: Link, splits: Sequence[Split],
                times: _LayerTimes | None = None, optimizer: OptimizerTerms = STATELESS,
                costs: Sequence[SplitCost] | None = None, working: FloatArray | None = None
                ) -> RangeCosts:
    """What every layer range of ``graph`` (a chain) costs one replica split over ``t``
    workers as ``splits`` says, on ``link`` (docs/design.md §10.3). ``Input`` layers cost
    no time. ``times``: its layers' (:func:`_layer_times`), ``costs``: each layer's split
    (:func:`_layer_costs`), ``working``: :func:`~dreampipe.planning.held.held_table`,
    where made already; ``optimizer``: what the optimizer holds beside the weights."""
    layers = graph.layers
    n = len(layers)
    bwd, weights, kept = (np.zeros(n) for _ in range(3))
    costs = costs or _layer_costs(graph, t, splits)
    for i, (layer, c) in enumerate(zip(layers, costs, strict=True)):
        share = c.compute_ms / layer.compute_ms if layer.compute_ms > 0 else 0.0
        bwd[i] = layer.backward_ms / 1e3 * share * (0.0 if layer.is_input else 1.0)
        weights[i] = c.weight_bytes
        whole = float(layer.activation_bytes)
        kept[i] = layer.stash_bytes * (c.activation_bytes / whole if whole else 1.0)
    compute, forward = _range_times(graph, t, link, splits, times=times, costs=costs)
    stashed = _sums(kept, 0.0)
    return RangeCosts(
        compute, _sums(weights, 0.0), stashed, np.asarray(graph.cut_bytes(), dtype=np.float64),
        forward_s=np.minimum(forward, np.where(np.isfinite(compute), compute, 0.0)),
        layer_backward_s=bwd, layer_weights=weights, stashed=stashed,
        working=held_table(graph) if working is None else working, optimizer=optimizer,
        copied=np.asarray(input_copies(graph), dtype=np.float64),
    )


def _layer_costs(graph: LayerGraph, t: int, splits: Sequence[Split]) -> list[SplitCost]:
    """What each layer of ``graph`` costs each of ``t`` workers split as ``splits`` says."""
    layers = graph.layers
    return [split_cost(layer, op_kind(layer), split, t,
                       float(layers[max(i - 1, 0)].activation_bytes))
            for i, (layer, split) in enumerate(zip(layers, splits, strict=True))]


def split_latencies(graph: LayerGraph, t: int, link: Link, splits: Sequence[Split],
                    times: _LayerTimes | None = None, costs: Sequence[SplitCost] | None = None
                    ) -> tuple[FloatArray, FloatArray]:
    """``(compute, forward)``: the parts of :func:`split_costs`' times that are its
    collectives' message latencies, which a smaller microbatch does not shrink
    (``times``: its layers', ``costs``: each layer's split, where made already)."""
    compute, forward = _range_times(graph, t, Link(math.inf, link.latency_s), splits,
                                    timed=False, times=times, costs=costs)
    return np.where(np.isfinite(compute), compute, 0.0), forward


def _range_times(graph: LayerGraph, t: int, link: Link, splits: Sequence[Split],
                 timed: bool = True, times: _LayerTimes | None = None,
                 costs: Sequence[SplitCost] | None = None) -> tuple[FloatArray, FloatArray]:
    """``[i, j]``: a replica's forward and backward and its forward alone, collectives and
    reshards at the range's edges included (a recomputed forward runs its own collectives
    again); the collectives alone unless ``timed``."""
    layers = graph.layers
    n = len(layers)
    own, fwd, own_fwd, needs, gives = times or _layer_times(graph, t, link, splits, timed,
                                                            costs)
    act = [float(x.activation_bytes) for x in layers]
    enter, inner, leave = _edge_moves(gives, needs, act, t, link)
    inside = upper(n)
    body = _sums(own, 0.0) + _sums(inner, 0.0) - inner[:, None]
    compute = np.where(inside, enter[:, None] + body + leave[None, :], np.inf)
    ahead = _edge_moves(gives, needs, act, t, link, forward_only=True)
    forward = np.where(inside, ahead[0][:, None] + _sums(fwd + own_fwd + ahead[1], 0.0)
                       - ahead[1][:, None] + ahead[2][None, :], 0.0)
    return compute, forward


def _layer_times(graph: LayerGraph, t: int, link: Link, splits: Sequence[Split], timed: bool,
                 costs: Sequence[SplitCost] | None = None) -> _LayerTimes:
    """Each layer's time inside a stage (its own collectives included, the collectives
    alone unless ``timed``), its forward's compute and its forward's own collectives, and
    the layouts it needs and gives (``costs``: each layer's split, where made already)."""
    layers = graph.layers
    n = len(layers)
    own, fwd, own_fwd = (np.zeros(n) for _ in range(3))
    needs: list[Layout] = []
    gives: list[Layout] = []
    costs = costs or _layer_costs(graph, t, splits)
    for i, (layer, split, c) in enumerate(zip(layers, splits, costs, strict=True)):
        seconds, comm = cost_seconds(c, t, link)
        share = c.compute_ms / layer.compute_ms if layer.compute_ms > 0 else 0.0
        work = 0.0 if layer.is_input else 1.0
        own[i] = seconds - c.compute_ms / 1e3 * (1 - work) if timed else comm
        fwd[i] = layer.forward_ms / 1e3 * share * work if timed else 0.0
        own_fwd[i] = _own_forward(split, c.collectives, t, link) * work
        needs.append(c.needs)
        gives.append(c.gives)
    return own, fwd, own_fwd, needs, gives


def _edge_moves(gives: Sequence[Layout], needs: Sequence[Layout], act: Sequence[float], t: int,
                link: Link, forward_only: bool = False
                ) -> tuple[FloatArray, FloatArray, FloatArray]:
    """The reshards (the forward's alone if ``forward_only``): into each layer as a
    stage's first (``enter``), between layers (``inner``, into layer ``i``), and out of
    each as a stage's last (``leave``)."""
    n, only = len(needs), forward_only
    priced: dict[tuple[Layout, Layout, float], float] = {}  # a profile repeats its moves

    def moves(src: Layout, dst: Layout, size: float) -> float:
        key = (src, dst, size)
        if key not in priced:
            priced[key] = _moves(src, dst, size, t, link, only)
        return priced[key]

    enter = np.array([min(moves(src, needs[0], act[0])
                          for src in (Layout.REPLICATED, Layout.BATCH))]
                     + [moves(Layout.REPLICATED, needs[i], act[i - 1]) for i in range(1, n)])
    inner = np.array([0.0] + [moves(gives[i - 1], needs[i], act[i - 1]) for i in range(1, n)])
    leave = np.array([moves(gives[j], Layout.REPLICATED, act[j]) for j in range(n - 1)]
                     + [link.seconds(Collective.ALL_REDUCE, act[-1], t)
                        if gives[-1] is Layout.PARTIAL else 0.0])
    return enter, inner, leave


def fits_servers(start: int, stop: int, t: int, topology: Topology) -> bool:
    """Whether workers ``start..stop-1`` hold whole replicas of ``t`` workers, each inside
    one server (the innermost level's unit)."""
    size = topology.levels[0].count
    if t < 2 or (stop - start) % t or t > size:
        return False
    return all(w // size == (w + t - 1) // size for w in range(start, stop, t))


def split_options(graph: LayerGraph, topology: Topology, widths: Sequence[int],
                  optimizer: OptimizerTerms = STATELESS) -> tuple[StageSplit, ...]:
    """For each ``t`` of ``widths``, the fastest and the leanest split of ``graph`` (one when
    they agree), priced on the link inside a server, with what ``optimizer`` holds beside
    the weights; none when ``graph`` is not a chain."""
    if not graph.is_chain or len(graph) < 1:
        return ()
    inner = topology.levels[0]
    link = Link(inner.bandwidth, inner.latency)
    out: list[StageSplit] = []
    working = held_table(graph)  # the same for every split
    for t in sorted(set(widths)):
        found = split_front(graph, t, link, optimizer)
        seen: set[tuple[Split, ...]] = set()
        for plan in found:
            if plan.splits not in seen:
                seen.add(plan.splits)
                costs = _layer_costs(graph, t, plan.splits)
                timed = _layer_times(graph, t, link, plan.splits, True, costs)
                alone = _layer_times(graph, t, Link(math.inf, link.latency_s), plan.splits,
                                     False, costs)
                out.append(StageSplit(
                    t, plan.splits, split_costs(graph, t, link, plan.splits, timed,
                                                optimizer, costs, working),
                    split_latencies(graph, t, link, plan.splits, alone, costs),
                    (timed[0], alone[0])))
    return tuple(out)

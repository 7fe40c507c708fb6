"""PipeDream's dynamic program over a topology's levels, as NumPy tables.

Each level's table ``A(i..j, m | context)`` is the best pipeline over layers
``i..j`` on ``m`` units, solved once per context (the units the enclosing
blocks use above) so that every stage's all-reduce is priced on its true
layout; the result equals :func:`~dreampipe.planning.planner.evaluate_plan`
of the same layout, term for term. The recurrence peels the first stage,
and its inner minimum is a min-max product (:mod:`dreampipe.planning.minmax`),
pruned exactly (:func:`_limits`). Each entry also keeps its plan's memory
slack. The recurrence and contexts: docs/design.md §4.1; pruning: §4.3;
memory: §4.4; ``CostModel.PIPEDREAM``'s terms: §6.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dreampipe.planning.costs import (
    CostModel,
    FloatArray,
    RangeCosts,
    cut_time,
    stage_time,
)
from dreampipe.planning.level import (
    FEWER,
    SINGLE,
    Floor,
    Options,
    StageTimes,
    Table,
    solve_level,
)
from dreampipe.planning.pipedream_costs import pipedream_allreduce_time, pipedream_stage_times
from dreampipe.planning.split_ranges import StageSplit
from dreampipe.planning.sync import allreduce_seconds, allreduce_terms
from dreampipe.planning.topology import Topology

__all__ = ["FlatStage", "Options", "best_plan"]

log = logging.getLogger(__name__)

Context = tuple[int, ...]  # units used by each enclosing block, level k+1 outwards
_Tables = list[dict[Context, "Table"]]

def _contexts(topo: Topology, k: int, opts: Options) -> list[Context]:
    """The contexts level ``k`` is solved in: every choice of units above it (dreampipe)."""
    if opts.model is CostModel.PIPEDREAM:
        return [()]
    tops = [1 if opts.straight else lv.count for lv in topo.levels[k + 1:]]
    return list(itertools.product(*(range(1, c + 1) for c in tops)))


def _bottom_times(
    prof: RangeCosts, topo: Topology, contexts: Sequence[Context], opts: Options, max_units: int,
) -> StageTimes:
    """``max(C, F + end) / m`` of a bottom stage on ``m`` workers in each context.

    The all-reduce ends of all contexts come from one batched call per ``m``
    (:func:`~dreampipe.planning.costs.allreduce_ends`); a layout without
    terms (one replica) has none.
    """
    out = {}
    for m in range(1, max_units + 1):
        terms = np.array([allreduce_terms((m, *ctx), topo.levels, opts.sync) for ctx in contexts])
        end = prof.allreduce_ends(terms[:, 0], terms[:, 1], overlap=topo.overlap)
        end[(terms == 0.0).all(axis=1)] = 0.0
        t = stage_time(prof.compute_s, prof.forward, end, m)
        for q in range(opts.slots):
            out[q, m] = t
    return out


def _bound(topo: Topology, opts: Options, bottom: StageTimes) -> float:
    """How slow an optimal plan may be, at most: one stage on every unit of every level
    is a plan the DP considers, and its time, ``bottom[0, count]`` in the context of all
    units above divided by each level's count above as the DP divides, bounds the
    optimum. ``inf`` (no bound) with memory limits, no replication, PipeDream's terms."""
    if opts.memory_bytes is not None or opts.straight or opts.model is CostModel.PIPEDREAM:
        return math.inf
    bound = float(bottom[0, topo.levels[0].count][-1, 0, -1])
    for level in topo.levels[1:]:
        bound /= level.count
    return bound


def _limits(contexts: Sequence[Context], bound: float) -> FloatArray:
    """How slow a part of a level's tables may be and still be in an optimal plan.

    An entry in context ``(m_k+1, ...)`` counts ``1 / (m_k+1 ...)`` of its time
    in the plan, so one above ``bound`` (:func:`_bound`) times that product
    is in no optimal plan (1e-9 of margin for the order of the divisions).
    """
    return np.array([bound * math.prod(ctx) * (1 + 1e-9) for ctx in contexts])


def _floor(prof: RangeCosts, topo: Topology, contexts: Sequence[Context],
           bound: float) -> Floor | None:
    """The :class:`~dreampipe.planning.level.Floor` of a level solved in ``contexts``
    (each copies the level's blocks ``prod(context)`` times); None without a bound."""
    if not math.isfinite(bound):
        return None
    whole = float(prof.compute_s[0, prof.n - 1])
    copies = np.array([math.prod(ctx) for ctx in contexts], dtype=np.float64)
    return Floor(whole - prof.compute_s, bound * (1 + 1e-9), copies, topo.num_workers)


def _solve(prof: RangeCosts, topo: Topology, opts: Options) -> _Tables:
    """All levels' tables by context, innermost first; the last holds the answer."""
    n = prof.n
    fits = None
    if opts.memory_bytes is not None:
        fits = prof.max_versions(opts.memory_bytes) - 1.0
    tables: _Tables = []
    unit_gpus = 1
    last = len(topo.levels) - 1
    pipedream = opts.model is CostModel.PIPEDREAM
    for k, level in enumerate(topo.levels):
        max_units = 1 if opts.straight else level.count
        cut = cut_time(prof.cut_bytes[1:], level.bandwidth, level.latency)  # [t]: after t
        if pipedream:
            cut = np.zeros_like(cut)  # charged on the stage after the cut instead
        ctxs = _contexts(topo, k, opts)
        keys = [(q, m) for q in range(opts.slots) for m in range(1, max_units + 1)]
        if k == 0:
            inner_time = np.broadcast_to(prof.compute_s, (opts.slots, n, n))
            block_slack = None if fits is None else {
                key: np.broadcast_to(fits, (len(ctxs), n, n)) for key in keys}
        else:
            below = topo.levels[k - 1].count
            inner = {m: [tables[k - 1][() if pipedream else (m, *ctx)] for ctx in ctxs]
                     for m in range(1, max_units + 1)}
            inner_time = inner[1][0].time[:, below]
            block_slack = None if fits is None else {
                (q, m): np.stack([t.slack[q, below] for t in inner[m]]) for q, m in keys}
        if pipedream:
            below_units = topo.levels[k - 1].count if k else 1
            after, first = pipedream_stage_times(
                prof, inner_time, opts.slots, max_units, level.bandwidth, below_units)
        elif k == 0:
            after = first = _bottom_times(prof, topo, ctxs, opts, max_units)
            bottom = after
        else:
            after = first = {(q, m): np.stack([t.time[q, below] for t in inner[m]]) / m
                             for q, m in keys}
        if k == 0:
            bound = math.inf if pipedream else _bound(topo, opts, bottom)
        table = solve_level(prof, after, first, block_slack, level.count, cut, unit_gpus,
                             k == 0, k == last, opts, _limits(ctxs, bound),
                             _floor(prof, topo, ctxs, bound))
        tables.append({ctx: table.context(c) for c, ctx in enumerate(ctxs)})
        unit_gpus *= level.count
        log.debug("level %d (%d units, %d contexts) solved", k, level.count, len(ctxs))
    return tables


@dataclass
class FlatStage:
    """One stage of the back-tracked plan: layers, the workers that hold it, its terms.

    ``allreduce_s`` is one all-reduce of the stage's weights among its
    replicas per round; ``comm_s`` the cut after it, per minibatch;
    ``recompute``: the stage recomputes its activations in the backward;
    ``split``: each replica runs on ``split.t`` consecutive ``workers`` (None: one).
    """

    first: int
    last: int
    workers: tuple[int, ...]
    allreduce_s: float
    comm_s: float = 0.0
    recompute: bool = False
    split: StageSplit | None = None

    @property
    def replicas(self) -> int:
        return len(self.workers) // (1 if self.split is None else self.split.t)


def _flatten(
    prof: RangeCosts, topo: Topology, tables: _Tables, opts: Options, k: int,
    i: int, j: int, m: int, q: int, ctx: Context, bases: list[int], ar_share: float,
) -> list[FlatStage]:
    """Back-track level ``k``'s pipeline over ``i..j`` on ``m`` units into flat stages.

    ``bases`` are the first workers of every copy of the enclosing block;
    a stage on ``mu`` units from unit ``u`` holds, in every copy, the workers
    of those units.
    """
    pipedream = opts.model is CostModel.PIPEDREAM
    table, level = tables[k][ctx], topo.levels[k]
    size = math.prod(lv.count for lv in topo.levels[:k])  # workers per unit of this level
    out: list[FlatStage] = []
    unit = 0
    while True:
        c = j - table.first_col
        code = int(table.split[q, m, i, c])
        if code == FEWER:
            m -= 1
            continue
        last = j if code == SINGLE else code
        mu, qs = int(table.units[q, m, i, c]), int(table.slot[q, m, i, c])
        placed = [b + (unit + x) * size for b in bases for x in range(mu)]
        share = ar_share
        if pipedream:
            ar = float(pipedream_allreduce_time(prof.weights[i, last], mu, level.bandwidth))
            share = max(ar_share, ar / len(placed))
        if k == 0:
            w = prof.weights[i, last]
            ar = share * len(placed) if pipedream else float(
                allreduce_seconds(w, (mu, *ctx), topo.levels, opts.sync))
            out.append(FlatStage(i, last, tuple(sorted(placed)), ar))
        else:
            inner_ctx = () if pipedream else (mu, *ctx)
            out += _flatten(prof, topo, tables, opts, k - 1, i, last,
                            topo.levels[k - 1].count, qs, inner_ctx, placed, share)
        if code == SINGLE:
            return out
        out[-1].comm_s = float(cut_time(prof.cut_bytes[last + 1], level.bandwidth,
                                        0.0 if pipedream else level.latency)) / len(bases)
        i, m, unit = last + 1, m - mu, unit + mu
        q = q - qs - 1 if opts.limited else 0


def best_plan(
    prof: RangeCosts, models: Sequence[Topology], opts: Options
) -> tuple[float, list[FlatStage]] | None:
    """The fastest plan over the cost ``models`` (first wins ties), or None if none fits."""
    found: tuple[float, list[FlatStage]] | None = None
    for topo in models:
        tables = _solve(prof, topo, opts)
        top = len(tables) - 1
        count, q = topo.levels[-1].count, opts.slots - 1
        value = float(tables[top][()].time[q, count, 0, 0])
        if math.isfinite(value) and (found is None or value < found[0]):
            flat = _flatten(prof, topo, tables, opts, top, 0, prof.n - 1, count, q, (), [0], 0.0)
            found = (value, flat)
    return found

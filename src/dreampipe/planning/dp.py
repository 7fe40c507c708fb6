"""PipeDream's dynamic program over a topology's levels, as NumPy tables.

Level k of the topology groups ``m_k`` units of level k-1 (DESIGN §3). At
each level the best pipeline over layers ``i..j`` on ``m`` units is::

    A(i..j, m) = min( T(i..j, m),                               one stage, m units
                      min over i<=t<j, 1<=m'<m of
                      max( T(i..t, m'), cut(t), A(t+1..j, m-m') ) )
    T(i..t, m') = A_below(i..t | m', context) / m'       (a block of m' whole units)
    T(i..t, m)  = max(C, F + allreduce(w, (m, context))) / m       (at the bottom)

A replicated stage's all-reduce depends on how its replicas spread over
*every* level (:func:`dreampipe.planning.sync.allreduce_seconds`), so each
level's table is solved once per *context*, the units the enclosing blocks
use at the levels above (``(m_1, m_2, ...)``); the bottom level then prices
each stage's all-reduce on its true layout, and every cut at the level it
crosses. The result equals :func:`~dreampipe.planning.planner.evaluate_plan`
of the same layout, term for term.

DESIGN writes the recurrence peeling the last stage; peeling the *first*
gives the same minimum over all partitions and lets each stage know how many
workers lie after it, which the memory rule (versions in flight,
:mod:`dreampipe.planning.costs`) needs. The inner min over ``(t, m')`` is a
min-max matrix product (:mod:`dreampipe.planning.minmax`), done in NumPy for
all of a level's contexts and all ``m'`` at once, and pruned exactly by the
time of one stage on every unit, which bounds the optimum (:func:`_limits`).

Memory in a hierarchy: each table entry also keeps the *slack* of its plan,
``min over stages of (versions that fit x replicas - workers to the end)``,
counted inside one unit of the level above; a plan fits iff its slack is
>= 0 once placed, and placing a block of slack ``x`` on ``m'`` units with
``n`` units after it gives ``m' x - n * unit_gpus``. Exact on one level; on
more, the inner plans are chosen for speed among those that fit at the end.

Under ``CostModel.PIPEDREAM`` a stage costs PipeDream's additive term at its
own level (no context), a stage after a cut must obey ``RangeCosts.stage_ok``
and costs the plain term, and the first stage of a range on all of a level's
units divides its all-reduce by the units below (PipeDream's outer-level
rule); the DP is the same.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dreampipe.planning.costs import (
    CostModel,
    FloatArray,
    RangeCosts,
    cut_time,
    max_versions,
    stage_time,
)
from dreampipe.planning.minmax import best_splits
from dreampipe.planning.pipedream_costs import pipedream_allreduce_time, pipedream_stage_times
from dreampipe.planning.sync import DEFAULT_SYNC, Sync, allreduce_seconds, allreduce_terms
from dreampipe.planning.topology import Topology

__all__ = ["FlatStage", "Options", "best_plan"]

log = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]
_SINGLE = -1  # split code: the whole range is one stage
_FEWER = -2  # split code: the optimum uses one unit fewer


@dataclass(frozen=True)
class _Table:
    """One level's DP: entries ``[slot, i, j - first_col, units]``; while a level is
    solved, every array has a leading axis over its contexts."""

    time: FloatArray
    slack: FloatArray
    split: IntArray  # last layer of the first stage, or _SINGLE / _FEWER
    units: IntArray  # units of the first stage
    slot: IntArray  # stage-count slot of the first stage's inner plan
    first_col: int

    def context(self, k: int) -> _Table:
        """Context ``k``'s table, a view."""
        return _Table(self.time[k], self.slack[k], self.split[k], self.units[k], self.slot[k],
                      self.first_col)


@dataclass(frozen=True)
class Options:
    """What the search may do: memory per device, replication, idle workers, stage count, terms."""

    memory_bytes: int | None
    straight: bool
    allow_fewer: bool
    slots: int  # max_stages, or 1 for unlimited
    limited: bool  # slot q means "at most q+1 stages"; else one unlimited slot
    model: CostModel = CostModel.DREAMPIPE
    sync: Sync = DEFAULT_SYNC


Context = tuple[int, ...]  # units used by each enclosing block, level k+1 outwards


def _inner_slots(q: int, bottom: bool, limited: bool) -> Sequence[int]:
    """Slots the first stage's inner plan may use when the whole has slot ``q``.

    Slot ``q`` allows ``q + 1`` stages; a stage at the bottom level is exactly
    one, higher up it is a block whose inner plan takes ``qs + 1`` of them.
    """
    if not limited:
        return [0]
    if bottom:
        return [0] if q >= 1 else []
    return range(q)


_StageTimes = dict[tuple[int, int], FloatArray]  # (slot, units) -> [context, i, j]
_Tables = list[dict[Context, "_Table"]]


def _split_first(
    table: _Table, q: int, m: int, cands: Sequence[tuple[int, int]], stage_t: _StageTimes,
    block_slack: _StageTimes | None, cut: FloatArray, unit_gpus: int, limited: bool,
    limit: FloatArray,
) -> None:
    """Improve ``table``'s slot ``q`` on ``m`` units by a first stage, then the rest.

    ``cands`` are the first stage's ``(inner slot, units)`` in the plain loop's
    order, which :func:`~dreampipe.planning.minmax.best_splits` keeps on ties;
    ``limit[k]`` bounds the parts of a plan worth finding (:func:`_limits`).
    """
    n = table.time.shape[2]
    qs = np.array([s for s, _ in cands])
    mu = np.array([u for _, u in cands])
    rest_q = q - qs - 1 if limited else np.zeros_like(qs)
    x = np.stack([np.maximum(stage_t[s, u][:, :, : n - 1], cut[: n - 1]) for s, u in cands],
                 axis=2)  # [context, i, candidate, t]
    stage_slack = None
    if block_slack is not None:
        stage_slack = np.stack([u * block_slack[s, u][:, :, : n - 1] - (m - u) * unit_gpus
                                for s, u in cands], axis=2)
        x[stage_slack < 0] = np.inf
    # [context, c, candidate, t]: the rest t+1..c on the units left
    y = np.ascontiguousarray(table.time[:, rest_q, 1:, :, m - mu].transpose(1, 3, 0, 2))
    best = table.time[:, q, :, :, m]
    val, arg_u, arg_t = best_splits(x, y, best, limit, table.first_col)
    better = val < best
    if not better.any():
        return
    k, i, c = np.nonzero(better)
    u, t = arg_u[better], arg_t[better]
    best[better] = val[better]
    table.split[:, q, :, :, m][better] = t
    table.units[:, q, :, :, m][better] = mu[u]
    table.slot[:, q, :, :, m][better] = qs[u]
    if stage_slack is not None:
        table.slack[:, q, :, :, m][better] = np.minimum(
            stage_slack[k, i, u, t], table.slack[k, rest_q[u], t + 1, c, m - mu[u]])


def _solve_level(
    prof: RangeCosts,
    after_cut: _StageTimes,
    first_stage: _StageTimes,
    block_slack: _StageTimes | None,
    count: int,
    cut: FloatArray,
    unit_gpus: int,
    bottom: bool,
    top: bool,
    opts: Options,
    limit: FloatArray,
) -> _Table:
    """Fill one level's table for every range (or, at the top, every suffix), every context.

    ``after_cut[q, m]`` / ``first_stage[q, m]`` are the times ``[context, i, j]``
    of a stage on ``m`` units (one level down: a block, its inner plan in
    slot ``q``); ``block_slack[q, m]`` the memory slack of one unit of such a
    block; ``cut[t]`` the cut after layer ``t``; ``limit`` as in :func:`_split_first`.
    """
    n, slots = prof.n, opts.slots
    contexts = next(iter(after_cut.values())).shape[0]
    first_col = n - 1 if top else 0
    shape = (contexts, slots, n, n - first_col, count + 1)
    table = _Table(np.full(shape, np.inf), np.full(shape, np.inf),
                   np.full(shape, _SINGLE, dtype=np.int64), np.zeros(shape, dtype=np.int64),
                   np.zeros(shape, dtype=np.int64), first_col)
    time, slack = table.time, table.slack
    max_units = 1 if opts.straight else count
    for m in range(1, count + 1):
        stage_t = first_stage if m == count else after_cut
        for q in range(slots):
            best, best_slack = time[:, q, :, :, m], slack[:, q, :, :, m]
            if opts.allow_fewer and m > 1:
                best[:] = time[:, q, :, :, m - 1]
                best_slack[:] = slack[:, q, :, :, m - 1]
                table.split[:, q, :, :, m] = _FEWER
            if m <= max_units:
                single = stage_t[q, m][:, :, first_col:].copy()
                if block_slack is not None:
                    fit_slack = m * block_slack[q, m][:, :, first_col:]
                    single[fit_slack < 0] = np.inf
                better = single < best
                best[better] = single[better]
                if block_slack is not None:
                    best_slack[better] = fit_slack[better]
                table.split[:, q, :, :, m][better] = _SINGLE
                table.units[:, q, :, :, m][better] = m
                table.slot[:, q, :, :, m][better] = q
            cands = [(qs, mu) for qs in _inner_slots(q, bottom, opts.limited)
                     for mu in range(1, min(m - 1, max_units) + 1)]
            if cands:
                _split_first(table, q, m, cands, stage_t, block_slack, cut, unit_gpus,
                             opts.limited, limit)
    return table


def _contexts(topo: Topology, k: int, opts: Options) -> list[Context]:
    """The contexts level ``k`` is solved in: every choice of units above it (dreampipe)."""
    if opts.model is CostModel.PIPEDREAM:
        return [()]
    tops = [1 if opts.straight else lv.count for lv in topo.levels[k + 1:]]
    return list(itertools.product(*(range(1, c + 1) for c in tops)))


def _bottom_times(
    prof: RangeCosts, topo: Topology, contexts: Sequence[Context], opts: Options, max_units: int,
) -> _StageTimes:
    """``max(C, F + end) / m`` of a bottom stage on ``m`` workers in each context."""
    out = {}
    for m in range(1, max_units + 1):
        t = np.empty((len(contexts), prof.n, prof.n))
        for k, ctx in enumerate(contexts):
            lat, per = allreduce_terms((m, *ctx), topo.levels, opts.sync)
            end = prof.allreduce_end(lat, per, overlap=topo.overlap) if lat or per else 0.0
            t[k] = stage_time(prof.compute_s, prof.forward, end, m)
        for q in range(opts.slots):
            out[q, m] = t
    return out


def _limits(
    topo: Topology, k: int, contexts: Sequence[Context], opts: Options, bottom: _StageTimes,
) -> FloatArray:
    """How slow a part of level ``k``'s tables may be and still be in an optimal plan.

    One stage on every unit of every level is a plan the DP considers; its
    time, ``bottom[0, count]`` in the context of all units above divided by
    each level's count above as the DP divides, bounds the optimum. A level-k
    entry in context ``(m_k+1, ...)`` counts ``1 / (m_k+1 ...)`` of its time
    in the plan, so one above the bound times that product is in no optimal
    plan (1e-9 of margin for the order of the divisions). Without the bound
    (memory limits, no replication, PipeDream's terms): ``inf``.
    """
    if opts.memory_bytes is not None or opts.straight or opts.model is CostModel.PIPEDREAM:
        return np.full(len(contexts), np.inf)
    bound = float(bottom[0, topo.levels[0].count][-1, 0, -1])
    for level in topo.levels[1:]:
        bound /= level.count
    return np.array([bound * math.prod(ctx) * (1 + 1e-9) for ctx in contexts])


def _solve(prof: RangeCosts, topo: Topology, opts: Options) -> _Tables:
    """All levels' tables by context, innermost first; the last holds the answer."""
    n = prof.n
    fits = None
    if opts.memory_bytes is not None:
        fits = max_versions(prof.weights, prof.activations, opts.memory_bytes) - 1.0
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
            inner_time = inner[1][0].time[..., below]
            block_slack = None if fits is None else {
                (q, m): np.stack([t.slack[q, ..., below] for t in inner[m]]) for q, m in keys}
        if pipedream:
            below_units = topo.levels[k - 1].count if k else 1
            after, first = pipedream_stage_times(
                prof, inner_time, opts.slots, max_units, level.bandwidth, below_units)
        elif k == 0:
            after = first = _bottom_times(prof, topo, ctxs, opts, max_units)
            bottom = after
        else:
            after = first = {(q, m): np.stack([t.time[q, ..., below] for t in inner[m]]) / m
                             for q, m in keys}
        limit = np.full(len(ctxs), np.inf) if pipedream else _limits(topo, k, ctxs, opts, bottom)
        table = _solve_level(prof, after, first, block_slack, level.count, cut, unit_gpus,
                             k == 0, k == last, opts, limit)
        tables.append({ctx: table.context(c) for c, ctx in enumerate(ctxs)})
        unit_gpus *= level.count
        log.debug("level %d (%d units, %d contexts) solved", k, level.count, len(ctxs))
    return tables


@dataclass
class FlatStage:
    """One stage of the back-tracked plan: layers, the workers that hold it, its terms.

    ``allreduce_s`` is one all-reduce of the stage's weights among its
    replicas per round; ``comm_s`` the cut after it, per minibatch.
    """

    first: int
    last: int
    workers: tuple[int, ...]
    allreduce_s: float
    comm_s: float = 0.0

    @property
    def replicas(self) -> int:
        return len(self.workers)


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
        code = int(table.split[q, i, c, m])
        if code == _FEWER:
            m -= 1
            continue
        last = j if code == _SINGLE else code
        mu, qs = int(table.units[q, i, c, m]), int(table.slot[q, i, c, m])
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
        if code == _SINGLE:
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
        value = float(tables[top][()].time[q, 0, 0, count])
        if math.isfinite(value) and (found is None or value < found[0]):
            flat = _flatten(prof, topo, tables, opts, top, 0, prof.n - 1, count, q, (), [0], 0.0)
            found = (value, flat)
    return found

"""PipeDream's dynamic program over a topology's levels, as NumPy tables.

Level k of the topology groups ``m_k`` units of level k-1 (DESIGN §3). At
each level the best pipeline over layers ``i..j`` on ``m`` units is::

    A(i..j, m) = min( T(i..j, m),                               one stage, m replicas
                      min over i<=t<j, 1<=m'<m of
                      max( T(i..t, m'), 2 a_t+1 / B, A(t+1..j, m-m') ) )
    T(i..t, m') = max( A_below(i..t), 2(m'-1) |w| / B ) / m'

where ``A_below`` is the level below's optimum on one whole unit (the sum of
layer times at the bottom). DESIGN writes the recurrence peeling the last
stage; peeling the *first* gives the same minimum over all partitions and
lets each stage know how many workers lie after it, which the memory rule
(versions in flight, :mod:`dreampipe.planning.costs`) needs. The inner min over
``(t, m')`` is a min-max matrix product, done in NumPy.

Memory in a hierarchy: each table entry also keeps the *slack* of its plan,
``min over stages of (versions that fit x replicas - workers to the end)``,
counted inside one unit of the level above; a plan fits iff its slack is
>= 0 once placed, and placing a block of slack ``x`` on ``m'`` units with
``n`` units after it gives ``m' x - n * unit_gpus``. Exact on one level; on
more, the inner plans are chosen for speed among those that fit at the end.

The stage term is a parameter (:class:`~dreampipe.planning.costs.CostModel`):
under ``PIPEDREAM`` a stage costs PipeDream's additive term, a stage after a
cut must obey ``RangeCosts.stage_ok`` and costs the plain term, and the
first stage of a range on all of a level's units divides its all-reduce by
the units below (PipeDream's outer-level rule); the DP is the same.
"""

from __future__ import annotations

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
    allreduce_time,
    cut_time,
    max_versions,
    replicated_stage_time,
)
from dreampipe.planning.pipedream_costs import (
    pipedream_allreduce_time,
    pipedream_stage_time,
    pipedream_transfer_time,
)
from dreampipe.planning.topology import Topology

__all__ = ["FlatStage", "Options", "best_plan"]

log = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]
_SINGLE = -1  # split code: the whole range is one stage
_FEWER = -2  # split code: the optimum uses one unit fewer
_CUBE = 1 << 21  # elements per min-max block, bounds temporary memory


@dataclass(frozen=True)
class _Table:
    """One level's DP: entries ``[slot, i, j - first_col, units]``."""

    time: FloatArray
    slack: FloatArray
    split: IntArray  # last layer of the first stage, or _SINGLE / _FEWER
    units: IntArray  # units of the first stage
    slot: IntArray  # stage-count slot of the first stage's inner plan
    first_col: int


@dataclass(frozen=True)
class Options:
    """What the search may do: memory per device, replication, idle workers, stage count, terms."""

    memory_bytes: int | None
    straight: bool
    allow_fewer: bool
    slots: int  # max_stages, or 1 for unlimited
    limited: bool  # slot q means "at most q+1 stages"; else one unlimited slot
    model: CostModel = CostModel.DREAMPIPE


def _minmax(x: FloatArray, y: FloatArray, first_col: int) -> tuple[FloatArray, IntArray]:
    """``min_t max(x[i, t], y[t, c])`` and its argmin, skipping ``t < i`` and ``j <= i``.

    The cube is laid out ``[i, c, t]`` so the reduction runs over contiguous memory.
    """
    rows, width = x.shape
    cols = y.shape[1]
    y_t = np.ascontiguousarray(y.T)
    val = np.full((rows, cols), np.inf)
    arg = np.zeros((rows, cols), dtype=np.int64)
    i0 = 0
    while i0 < min(rows, width):
        c0 = max(0, i0 + 1 - first_col)
        if c0 >= cols:
            break
        block = (width - i0) * (cols - c0)
        i1 = min(rows, i0 + max(1, _CUBE // block))
        cube = np.maximum(x[i0:i1, None, i0:], y_t[None, c0:, i0:])
        a = cube.argmin(axis=2)
        val[i0:i1, c0:] = np.take_along_axis(cube, a[:, :, None], axis=2)[:, :, 0]
        arg[i0:i1, c0:] = a + i0
        i0 = i1
    return val, arg


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


_StageTimes = dict[tuple[int, int], FloatArray]


def _stage_times(
    prof: RangeCosts, inner_time: FloatArray, slots: int, max_units: int, bandwidth: float,
    below: int, model: CostModel,
) -> tuple[_StageTimes, _StageTimes]:
    """Stage times ``[(slot, m)] -> [i, j]``: after a cut, and first of a whole level's range.

    The two differ only under ``PIPEDREAM`` (cut rule; all-reduce shared by
    the ``below`` units of a server); otherwise they are the same table.
    """
    keys = [(q, m) for q in range(slots) for m in range(1, max_units + 1)]
    if model is CostModel.DREAMPIPE:
        same = {(q, m): replicated_stage_time(inner_time[q], prof.weights, m, bandwidth)
                for q, m in keys}
        return same, same
    after, first = {}, {}
    n = prof.n
    before = np.concatenate([[0.0], prof.cut_bytes[:-1]])[:, None]  # out(s - 1)
    after_out = np.where(np.arange(n) < n - 1, prof.cut_bytes, 0.0)[None, :]  # out(e)
    for q, m in keys:
        t = np.maximum(pipedream_stage_time(inner_time[q], prof.weights, m, bandwidth),
                       pipedream_transfer_time(np.maximum(before, after_out), m, bandwidth))
        first[q, m] = pipedream_stage_time(inner_time[q], prof.weights, m, bandwidth, below)
        after[q, m] = t if prof.stage_ok is None else np.where(prof.stage_ok, t, np.inf)
    return after, first


def _solve_level(
    prof: RangeCosts,
    inner_time: FloatArray,
    inner_slack: FloatArray | None,
    count: int,
    bandwidth: float,
    unit_gpus: int,
    below: int,
    bottom: bool,
    top: bool,
    opts: Options,
) -> _Table:
    """Fill one level's table for every range (or, at the top, every suffix)."""
    n, slots = prof.n, opts.slots
    first_col = n - 1 if top else 0
    cols = n - first_col
    shape = (slots, n, cols, count + 1)
    time = np.full(shape, np.inf)
    slack = np.full(shape, np.inf)
    split = np.full(shape, _SINGLE, dtype=np.int64)
    units = np.zeros(shape, dtype=np.int64)
    slot_of = np.zeros(shape, dtype=np.int64)
    max_units = 1 if opts.straight else count
    after_cut, first_stage = _stage_times(
        prof, inner_time, slots, max_units, bandwidth, below, opts.model
    )
    cut = cut_time(prof.cut_bytes[1:], bandwidth)  # [t]: cut after layer t
    if opts.model is CostModel.PIPEDREAM:
        cut = np.zeros_like(cut)  # charged on the stage after the cut instead
    limited = opts.limited
    for m in range(1, count + 1):
        stage_t = first_stage if m == count else after_cut
        for q in range(slots):
            best, best_slack = time[q, :, :, m], slack[q, :, :, m]
            if opts.allow_fewer and m > 1:
                best[:] = time[q, :, :, m - 1]
                best_slack[:] = slack[q, :, :, m - 1]
                split[q, :, :, m] = _FEWER
            if m <= max_units:
                single = stage_t[q, m][:, first_col:].copy()
                if inner_slack is not None:
                    fit_slack = m * inner_slack[q][:, first_col:]
                    single[fit_slack < 0] = np.inf
                better = single < best
                best[better] = single[better]
                if inner_slack is not None:
                    best_slack[better] = fit_slack[better]
                split[q, :, :, m][better] = _SINGLE
                units[q, :, :, m][better] = m
                slot_of[q, :, :, m][better] = q
            for qs in _inner_slots(q, bottom, limited):
                rest_q = q - qs - 1 if limited else 0
                for mu in range(1, min(m - 1, max_units) + 1):
                    x = np.maximum(stage_t[qs, mu][:, : n - 1], cut[None, : n - 1])
                    if inner_slack is not None:
                        stage_slack = mu * inner_slack[qs][:, : n - 1] - (m - mu) * unit_gpus
                        x[stage_slack < 0] = np.inf
                    y = time[rest_q, 1:, :, m - mu]
                    val, arg = _minmax(x, y, first_col)
                    better = val < best
                    if not better.any():
                        continue
                    best[better] = val[better]
                    split[q, :, :, m][better] = arg[better]
                    units[q, :, :, m][better] = mu
                    slot_of[q, :, :, m][better] = qs
                    if inner_slack is not None:
                        rows, cidx = np.nonzero(better)
                        t = arg[better]
                        best_slack[better] = np.minimum(
                            stage_slack[rows, t], slack[rest_q, t + 1, cidx, m - mu]
                        )
    return _Table(time, slack, split, units, slot_of, first_col)


def _solve(prof: RangeCosts, topo: Topology, opts: Options) -> list[_Table]:
    """All levels' tables, innermost first; the last holds the answer."""
    n = prof.n
    inner_time = np.broadcast_to(prof.compute_s, (opts.slots, n, n))
    inner_slack: FloatArray | None = None
    if opts.memory_bytes is not None:
        fits = max_versions(prof.weights, prof.activations, opts.memory_bytes) - 1.0
        inner_slack = np.broadcast_to(fits, (opts.slots, n, n))
    tables: list[_Table] = []
    unit_gpus = 1
    last = len(topo.levels) - 1
    for k, level in enumerate(topo.levels):
        below = topo.levels[k - 1].count if k else 1
        table = _solve_level(
            prof, inner_time, inner_slack, level.count, level.bandwidth, unit_gpus, below,
            k == 0, k == last, opts,
        )
        tables.append(table)
        inner_time = table.time[..., level.count]
        inner_slack = None if inner_slack is None else table.slack[..., level.count]
        unit_gpus *= level.count
        log.debug("level %d (%d units) solved", k, level.count)
    return tables


@dataclass
class FlatStage:
    """One stage of the back-tracked plan, in layers and workers of the whole cluster."""

    first: int
    last: int
    replicas: int
    allreduce_share: float
    comm_s: float = 0.0


def _flatten(
    prof: RangeCosts, topo: Topology, tables: list[_Table], opts: Options, k: int,
    i: int, j: int, m: int, q: int, outer: int, ar_share: float,
) -> list[FlatStage]:
    """Back-track level ``k``'s pipeline over ``i..j`` on ``m`` units into flat stages."""
    table, level = tables[k], topo.levels[k]
    out: list[FlatStage] = []
    while True:
        c = j - table.first_col
        code = int(table.split[q, i, c, m])
        if code == _FEWER:
            m -= 1
            continue
        last = j if code == _SINGLE else code
        mu, qs = int(table.units[q, i, c, m]), int(table.slot[q, i, c, m])
        if opts.model is CostModel.PIPEDREAM:
            ar = float(pipedream_allreduce_time(prof.weights[i, last], mu, level.bandwidth))
        else:
            ar = float(allreduce_time(prof.weights[i, last], mu, level.bandwidth))
        ar /= mu * outer
        share = max(ar_share, ar)
        if k == 0:
            out.append(FlatStage(i, last, mu * outer, share))
        else:
            out += _flatten(prof, topo, tables, opts, k - 1, i, last,
                            topo.levels[k - 1].count, qs, mu * outer, share)
        if code == _SINGLE:
            return out
        out[-1].comm_s = float(cut_time(prof.cut_bytes[last + 1], level.bandwidth)) / outer
        i, m = last + 1, m - mu
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
        value = float(tables[top].time[q, 0, 0, count])
        if math.isfinite(value) and (found is None or value < found[0]):
            flat = _flatten(prof, topo, tables, opts, top, 0, prof.n - 1, count, q, 1, 0.0)
            found = (value, flat)
    return found

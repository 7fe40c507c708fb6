"""One level of the planner's dynamic program: its table and how it is filled.

:func:`solve_level` fills, for every context at once, the best pipeline over
each layer range on each unit count (:mod:`dreampipe.planning.dp` gives the
recurrence). Each unit count's candidate first stages and rests are slices
of two arrays built once per level (:func:`_first_parts`, and ``rest``,
the table transposed as it fills), so no count copies or rebuilds them; the
table keeps the unit count before the range axes so that each count's
entries are contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dreampipe.planning.costs import CostModel, FloatArray, RangeCosts
from dreampipe.planning.minmax import best_splits, index_dtype
from dreampipe.planning.sync import DEFAULT_SYNC, Sync

__all__ = ["FEWER", "SINGLE", "Floor", "Options", "StageTimes", "Table", "solve_level"]

IntArray = npt.NDArray[np.signedinteger[Any]]
SINGLE = -1  # split code: the whole range is one stage
FEWER = -2  # split code: the optimum uses one unit fewer


@dataclass(frozen=True)
class Table:
    """One level's DP: entries ``[slot, units, i, j - first_col]``; while a level is
    solved, every array has a leading axis over its contexts."""

    time: FloatArray
    slack: FloatArray
    # the index arrays hold layers, unit counts and slots: int16 where they fit (index_dtype)
    split: IntArray  # last layer of the first stage, or SINGLE / FEWER
    units: IntArray  # units of the first stage
    slot: IntArray  # stage-count slot of the first stage's inner plan
    first_col: int

    def context(self, k: int) -> Table:
        """Context ``k``'s table, a view."""
        return Table(self.time[k], self.slack[k], self.split[k], self.units[k], self.slot[k],
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


@dataclass(frozen=True)
class Floor:
    """What the layers outside a range need, to prune entries no optimal plan holds.

    A plan is at least as slow as ``outside[i, j]``, the compute of the layers
    outside ``i..j``, over the workers left to them: every stage takes at
    least its compute over its replicas, and the largest such ratio is at
    least their sums' ratio. A level-``k`` range on ``m`` units in context
    ``c`` takes ``m * unit_gpus * copies[c]`` of the ``workers``; where the rest
    cannot finish within ``bound`` (an upper bound on the optimum: one stage
    on every unit), the entry is in no optimal plan, and the search skips it.
    """

    outside: FloatArray  # [i, j]
    bound: float
    copies: FloatArray  # [context]: copies of a level-k block the context makes
    workers: int

    def hopeless(self, m: int, unit_gpus: int, first_col: int) -> npt.NDArray[np.bool_]:
        """``[context, i, c]``: entries on ``m`` units whose outside cannot keep up."""
        left = self.workers - m * unit_gpus * self.copies
        return np.asarray(self.outside[None, :, first_col:] * (1 - 1e-9)
                          > self.bound * left[:, None, None], dtype=bool)


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


StageTimes = dict[tuple[int, int], FloatArray]  # (slot, units) -> [context, i, j]


def _first_parts(stage_t: StageTimes, cut: FloatArray, slots: int, units: int) -> FloatArray:
    """``[slot, context, i, units - 1, t]``: a first stage ``i..t`` with the cut after it.

    Built once per level; every unit count's candidates are a slice of it.
    """
    ctx, n = next(iter(stage_t.values())).shape[:2]
    out = np.empty((slots, ctx, n, units, n - 1))
    for s in range(slots):
        for u in range(1, units + 1):
            np.maximum(stage_t[s, u][:, :, : n - 1], cut[: n - 1], out=out[s, :, :, u - 1])
    return out


def _split_first(
    table: Table, rest: FloatArray, q: int, m: int, inner: Sequence[int], parts: FloatArray,
    block_slack: StageTimes | None, unit_gpus: int, limited: bool, limit: FloatArray,
    hopeless: npt.NDArray[np.bool_] | None,
) -> None:
    """Improve ``table``'s slot ``q`` on ``m`` units by a first stage, then the rest.

    The candidates are a first stage in each ``inner`` slot on 1.. units, in
    the plain loop's order, which :func:`~dreampipe.planning.minmax.best_splits`
    keeps on ties: slices of ``parts`` (:func:`_first_parts`) and of ``rest``,
    ``[context, slot, c, units, t]``, the rest ``t+1..c`` on the units left;
    ``limit[k]`` bounds the parts of a plan worth finding
    (``_limits`` in :mod:`dreampipe.planning.dp`); ``hopeless`` entries
    (:class:`Floor`) are not searched.
    """
    top = min(m - 1, parts.shape[3])
    qs = np.repeat(np.asarray(inner, dtype=np.int64), top)
    mu = np.tile(np.arange(1, top + 1), len(inner))
    rest_q = q - qs - 1 if limited else np.zeros_like(qs)
    xs = [parts[s, :, :, :top] for s in inner]  # [context, i, candidate, t]
    ys = [rest[:, int(r), :, m - 1: m - top - 1: -1] for r in rest_q[::top]]  # [.., c, ..]
    x = xs[0] if len(xs) == 1 else np.concatenate(xs, axis=2)
    y = ys[0] if len(ys) == 1 else np.concatenate(ys, axis=2)
    stage_slack = None
    if block_slack is not None:
        n = x.shape[3] + 1
        stage_slack = np.stack([u * block_slack[int(s), int(u)][:, :, : n - 1] - (m - u) * unit_gpus
                                for s, u in zip(qs, mu, strict=True)], axis=2)
        x = np.where(stage_slack < 0, np.inf, x)
    best = table.time[:, q, m]
    wanted = best if hopeless is None else np.where(hopeless, -np.inf, best)
    val, arg_u, arg_t = best_splits(x, y, wanted, limit, table.first_col)
    better = val < best
    if not better.any():
        return
    k, i, c = np.nonzero(better)
    u, t = arg_u[better], arg_t[better]
    best[better] = val[better]
    table.split[:, q, m][better] = t
    table.units[:, q, m][better] = mu[u]
    table.slot[:, q, m][better] = qs[u]
    if stage_slack is not None:
        table.slack[:, q, m][better] = np.minimum(
            stage_slack[k, i, u, t], table.slack[k, rest_q[u], m - mu[u], t + 1, c])


def solve_level(
    prof: RangeCosts,
    after_cut: StageTimes,
    first_stage: StageTimes,
    block_slack: StageTimes | None,
    count: int,
    cut: FloatArray,
    unit_gpus: int,
    bottom: bool,
    top: bool,
    opts: Options,
    limit: FloatArray,
    floor: Floor | None = None,
) -> Table:
    """Fill one level's table for every range (or, at the top, every suffix), every context.

    ``after_cut[q, m]`` / ``first_stage[q, m]`` are the times ``[context, i, j]``
    of a stage on ``m`` units (one level down: a block, its inner plan in
    slot ``q``); ``block_slack[q, m]`` the memory slack of one unit of such a
    block; ``cut[t]`` the cut after layer ``t``; ``limit`` as in :func:`_split_first`;
    ``floor`` prunes what no optimal plan holds (None: nothing).
    """
    n, slots = prof.n, opts.slots
    contexts = next(iter(after_cut.values())).shape[0]
    first_col = n - 1 if top else 0
    shape = (contexts, slots, count + 1, n, n - first_col)
    # without a memory limit no level reads the slack: a read-only stand-in, not 4 bytes an entry
    slack = np.full(shape, np.inf) if block_slack is not None else np.broadcast_to(np.inf, shape)
    index = index_dtype(max(n, count + 1, slots))
    table = Table(np.full(shape, np.inf), slack, np.full(shape, SINGLE, dtype=index),
                   np.zeros(shape, dtype=index), np.zeros(shape, dtype=index), first_col)
    time = table.time
    max_units = 1 if opts.straight else count
    units = min(count - 1, max_units)
    after_parts = _first_parts(after_cut, cut, slots, units)
    first_parts = after_parts if first_stage is after_cut else _first_parts(
        first_stage, cut, slots, units)
    rest = np.empty((contexts, slots, n - first_col, count + 1, n - 1))
    for m in range(1, count + 1):
        stage_t = first_stage if m == count else after_cut
        hopeless = None if floor is None else floor.hopeless(m, unit_gpus, first_col)
        for q in range(slots):
            best = time[:, q, m]
            if opts.allow_fewer and m > 1:
                best[:] = time[:, q, m - 1]
                if block_slack is not None:
                    slack[:, q, m] = slack[:, q, m - 1]
                table.split[:, q, m] = FEWER
            if m <= max_units:
                single = stage_t[q, m][:, :, first_col:]
                if block_slack is not None:
                    fit_slack = m * block_slack[q, m][:, :, first_col:]
                    single = np.where(fit_slack < 0, np.inf, single)
                better = single < best
                if block_slack is not None:
                    np.copyto(slack[:, q, m], fit_slack, where=better)
                np.copyto(best, single, where=better)
                np.copyto(table.split[:, q, m], SINGLE, where=better)
                np.copyto(table.units[:, q, m], m, where=better)
                np.copyto(table.slot[:, q, m], q, where=better)
            inner = _inner_slots(q, bottom, opts.limited)
            if inner and m > 1 and units > 0:
                _split_first(table, rest, q, m, inner,
                             first_parts if m == count else after_parts, block_slack, unit_gpus,
                             opts.limited, limit, hopeless)
        rest[:, :, :, m] = time[:, :, m, 1:].transpose(0, 1, 3, 2)
    return table

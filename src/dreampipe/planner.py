"""PipeDream's hierarchical dynamic program: cut a model into replicated stages.

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
(versions in flight, :mod:`dreampipe.costs`) needs. The inner min over
``(t, m')`` is a min-max matrix product, done in NumPy.

Memory in a hierarchy: each table entry also keeps the *slack* of its plan,
``min over stages of (versions that fit x replicas - workers to the end)``,
counted inside one unit of the level above; a plan fits iff its slack is
>= 0 once placed, and placing a block of slack ``x`` on ``m'`` units with
``n`` units after it gives ``m' x - n * unit_gpus``. Exact on one level; on
more, the inner plans are chosen for speed among those that fit at the end.

The hierarchy forces every outer stage onto whole servers, so a paper config
such as ``15-1`` on 2x8 cannot be expressed; :func:`plan` therefore also
solves the flat problem at the slowest link (any layout, pessimistic links)
and keeps whichever predicts the shorter time.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dreampipe.costs import (
    FloatArray,
    RangeCosts,
    allreduce_time,
    cut_time,
    gpipe_time,
    max_versions,
    replicated_stage_time,
    stage_memory,
)
from dreampipe.errors import PlanError
from dreampipe.graph import LayerGraph
from dreampipe.plan import Plan, Stage
from dreampipe.topology import Topology
from dreampipe.units import format_bytes

__all__ = ["FLAT_MAX_WORKERS", "evaluate", "plan"]

log = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]
_SINGLE = -1  # split code: the whole range is one stage
_FEWER = -2  # split code: the optimum uses one unit fewer
_CUBE = 1 << 21  # elements per min-max block, bounds temporary memory

#: :func:`plan` also tries the flat model up to this many workers; beyond, a
#: stage spans whole servers out of many and server alignment costs little.
FLAT_MAX_WORKERS = 64


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
class _Options:
    memory_bytes: int | None
    straight: bool
    allow_fewer: bool
    slots: int  # max_stages, or 1 for unlimited
    limited: bool  # slot q means "at most q+1 stages"; else one unlimited slot


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


def _solve_level(
    prof: RangeCosts,
    inner_time: FloatArray,
    inner_slack: FloatArray | None,
    count: int,
    bandwidth: float,
    unit_gpus: int,
    bottom: bool,
    top: bool,
    opts: _Options,
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
    stage_t = {
        (q, m): replicated_stage_time(inner_time[q], prof.weights, m, bandwidth)
        for q in range(slots)
        for m in range(1, max_units + 1)
    }
    cut = cut_time(prof.cut_bytes[1:], bandwidth)  # [t]: cut after layer t
    limited = opts.limited
    for m in range(1, count + 1):
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


def _solve(prof: RangeCosts, topo: Topology, opts: _Options) -> list[_Table]:
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
        table = _solve_level(
            prof, inner_time, inner_slack, level.count, level.bandwidth, unit_gpus,
            k == 0, k == last, opts,
        )
        tables.append(table)
        inner_time = table.time[..., level.count]
        inner_slack = None if inner_slack is None else table.slack[..., level.count]
        unit_gpus *= level.count
        log.debug("level %d (%d units) solved", k, level.count)
    return tables


@dataclass
class _Flat:
    first: int
    last: int
    replicas: int
    allreduce_share: float
    comm_s: float = 0.0


def _flatten(
    prof: RangeCosts, topo: Topology, tables: list[_Table], opts: _Options, k: int,
    i: int, j: int, m: int, q: int, outer: int, ar_share: float,
) -> list[_Flat]:
    """Back-track level ``k``'s pipeline over ``i..j`` on ``m`` units into flat stages."""
    table, level = tables[k], topo.levels[k]
    out: list[_Flat] = []
    while True:
        c = j - table.first_col
        code = int(table.split[q, i, c, m])
        if code == _FEWER:
            m -= 1
            continue
        last = j if code == _SINGLE else code
        mu, qs = int(table.units[q, i, c, m]), int(table.slot[q, i, c, m])
        ar = float(allreduce_time(prof.weights[i, last], mu, level.bandwidth)) / (mu * outer)
        share = max(ar_share, ar)
        if k == 0:
            out.append(_Flat(i, last, mu * outer, share))
        else:
            out += _flatten(prof, topo, tables, opts, k - 1, i, last,
                            topo.levels[k - 1].count, qs, mu * outer, share)
        if code == _SINGLE:
            return out
        out[-1].comm_s = float(cut_time(prof.cut_bytes[last + 1], level.bandwidth)) / outer
        i, m = last + 1, m - mu
        q = q - qs - 1 if opts.limited else 0


def _best(
    prof: RangeCosts, models: Sequence[Topology], opts: _Options
) -> tuple[float, list[_Flat]] | None:
    """The fastest plan over the cost ``models`` (first wins ties), or None if none fits."""
    found: tuple[float, list[_Flat]] | None = None
    for topo in models:
        tables = _solve(prof, topo, opts)
        top = len(tables) - 1
        count, q = topo.levels[-1].count, opts.slots - 1
        value = float(tables[top].time[q, 0, 0, count])
        if math.isfinite(value) and (found is None or value < found[0]):
            flat = _flatten(prof, topo, tables, opts, top, 0, prof.n - 1, count, q, 1, 0.0)
            found = (value, flat)
    return found


def _models(topo: Topology, also_flat: bool) -> list[Topology]:
    """The hierarchical model, and the flat one at the slowest link where it is cheap."""
    if also_flat and len(topo.levels) > 1 and topo.num_workers <= FLAT_MAX_WORKERS:
        return [topo, topo.flat()]
    return [topo]


def _baselines(
    prof: RangeCosts, models: Sequence[Topology], memory: int | None
) -> dict[str, float]:
    """Data parallelism, the best straight pipeline and GPipe on it, same cost models."""
    out: dict[str, float] = {}
    if memory is None or stage_memory(prof.weights[0, -1], prof.activations[0, -1], 1) <= memory:
        dps = []
        for topo in models:
            dp = float(prof.compute_s[0, -1])
            for level in topo.levels:
                dp = float(replicated_stage_time(dp, prof.weights[0, -1], level.count,
                                                 level.bandwidth))
            dps.append(dp)
        out["dp"] = min(dps)
    straight = _best(prof, models, _Options(memory, True, True, 1, False))
    if straight is not None:
        out["straight"] = straight[0]
        out["gpipe"] = gpipe_time(straight[0], len(straight[1]))
    return out


def _least_memory(prof: RangeCosts, models: Sequence[Topology], opts: _Options) -> int:
    """Smallest device memory (within 1%) at which some plan fits."""
    w, a = np.diag(prof.weights), np.diag(prof.activations)
    lo = float(np.max(2 * w + a))
    hi = float(models[0].num_workers * (prof.weights[0, -1] + prof.activations[0, -1])
               + prof.weights[0, -1])
    while hi > lo * 1.01:
        mid = math.sqrt(lo * hi)
        trial = _Options(math.ceil(mid), opts.straight, opts.allow_fewer, opts.slots, opts.limited)
        if _best(prof, models, trial) is None:
            lo = mid
        else:
            hi = mid
    return math.ceil(hi)


def _check_slots(max_stages: int | None, n: int) -> int:
    if max_stages is None:
        return 1
    if not 1 <= max_stages <= n:
        raise PlanError(
            f"max_stages={max_stages} is impossible for a model of {n} layers; "
            f"use 1..{n} (a stage holds at least one layer)"
        )
    return max_stages


def plan(
    graph: LayerGraph,
    topology: Topology,
    *,
    memory_bytes: int | None = None,
    straight: bool = False,
    allow_fewer_workers: bool = True,
    max_stages: int | None = None,
    also_flat: bool = True,
) -> Plan:
    """The fastest plan for ``graph`` on ``topology`` under PipeDream's cost model.

    ``memory_bytes`` rejects stages that do not fit (None: no limit, like
    PipeDream's optimizer by default); ``straight`` forbids replication;
    ``allow_fewer_workers`` lets idle workers stay idle when that is faster;
    ``max_stages`` caps the number of stages of the flattened plan;
    ``also_flat`` also solves the one-level problem at the slowest link
    (stages need not align with servers) and keeps it when faster.
    """
    prof = RangeCosts.of(graph)
    if memory_bytes is not None and memory_bytes <= 0:
        raise PlanError(f"memory_bytes={memory_bytes} must be positive, e.g. 16e9 for 16 GB")
    opts = _Options(memory_bytes, straight, allow_fewer_workers, _check_slots(max_stages, prof.n),
                    max_stages is not None)
    models = _models(topology, also_flat)
    best = _best(prof, models, opts)
    if best is None:
        free = _Options(None, straight, allow_fewer_workers, opts.slots, opts.limited)
        if memory_bytes is None or _best(prof, models, free) is None:
            raise PlanError(
                f"no plan uses exactly {topology.num_workers} workers on {prof.n} layers "
                f"with straight={straight}, max_stages={max_stages}; allow fewer workers, "
                "allow replication or raise max_stages"
            )
        need = _least_memory(prof, models, opts)
        raise PlanError(
            f"no plan fits in {format_bytes(memory_bytes)} per device; the smallest needs "
            f"about {format_bytes(need)}: raise --memory or profile a smaller minibatch"
        )
    value, flat = best
    spans = [(f.first, f.last, f.replicas) for f in flat]
    stages, rank = [], 0
    for f, mem in zip(flat, prof.memories(spans), strict=True):
        stages.append(Stage(
            f.first, f.last, f.replicas, tuple(range(rank, rank + f.replicas)),
            compute_s=float(prof.compute_s[f.first, f.last]), comm_s=f.comm_s,
            allreduce_s=f.allreduce_share * f.replicas, memory_bytes=mem,
        ))
        rank += f.replicas
    result = Plan(
        tuple(stages), prof.n, graph.batch_size, graph.model, topology.describe(), value,
        _baselines(prof, models, memory_bytes), tuple(x.name for x in graph.layers),
    )
    log.info("planned %s: %s", graph.model or "model", result.config)
    return result


def evaluate(
    graph: LayerGraph, topology: Topology, bounds: Sequence[int], replicas: Sequence[int]
) -> Plan:
    """Cost a GIVEN partition: stage s is ``bounds[s]..bounds[s+1]-1`` on ``replicas[s]`` ranks.

    Ranks are numbered stage by stage and laid on the topology in order;
    each all-reduce and each cut runs at the slowest link its ranks span.
    On a one-level topology this equals the DP's cost of the same plan.
    """
    prof = RangeCosts.of(graph)
    n = prof.n
    if len(bounds) > n:
        raise PlanError(f"{len(bounds)} stages forced on {n} layers; a stage needs a layer")
    edges = [*bounds, n]
    if not bounds or bounds[0] != 0 or any(b >= e for b, e in itertools.pairwise(edges)):
        raise PlanError(
            f"bounds {list(bounds)} must start at 0 and increase strictly below {n} layers"
        )
    if len(replicas) != len(bounds) or any(r < 1 for r in replicas):
        raise PlanError(
            f"replicas {list(replicas)}: need one count >= 1 per stage of bounds {list(bounds)}"
        )
    if sum(replicas) > topology.num_workers:
        raise PlanError(
            f"config {'-'.join(map(str, replicas))} needs {sum(replicas)} workers but the "
            f"topology has {topology.num_workers}; use a larger topology or fewer replicas"
        )
    spans = [(edges[s], edges[s + 1] - 1, r) for s, r in enumerate(replicas)]
    firsts = [sum(replicas[:s]) for s in range(len(replicas) + 1)]
    stages = []
    for s, ((first, last, r), mem) in enumerate(zip(spans, prof.memories(spans), strict=True)):
        bw = topology.bandwidth_between(firsts[s], firsts[s + 1] - 1)
        comm = 0.0
        if s + 1 < len(spans):
            link = topology.bandwidth_between(firsts[s], firsts[s + 2] - 1)
            comm = float(cut_time(prof.cut_bytes[last + 1], link))
        stages.append(Stage(
            first, last, r, tuple(range(firsts[s], firsts[s + 1])),
            compute_s=float(prof.compute_s[first, last]), comm_s=comm,
            allreduce_s=float(allreduce_time(prof.weights[first, last], r, bw)) if r > 1 else 0.0,
            memory_bytes=mem,
        ))
    return Plan(
        tuple(stages), n, graph.batch_size, graph.model, topology.describe(),
        max(st.time_s for st in stages), _baselines(prof, _models(topology, True), None),
        tuple(x.name for x in graph.layers),
    )

"""Stages on any contiguous range of workers: an exact DP over (layers, workers laid in order).

The hierarchical program (:mod:`dreampipe.planning.dp`) puts every outer
stage on whole units, so ``15-1`` on 4x4 is outside its search. Here the
workers are laid in rank order and every stage takes the next ``r`` of them,
wherever that range starts within a server, each term priced as
:func:`~dreampipe.planning.pricing.price_stages` prices that placement. A
stage's cost reads only its layers and range, a cut's only its layer and the
two ranges beside it, so the recursion ``H(i, s, e)`` over the first stage's
layers and range is exact; its work is ``O(N^2 W^3 / 6)``. Beyond
:data:`RANGES_MAX_WORKERS` workers, when the profile exceeds its budgets, it
runs on a grid of boundaries (:func:`range_points`) and the plan reports its
gap bound. The recursion and why it is exact: docs/design.md §4.5.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dreampipe.planning.costs import FloatArray, RangeCosts, stage_time
from dreampipe.planning.dp import FlatStage
from dreampipe.planning.pricing import contiguous_cut_shares
from dreampipe.planning.split_ranges import StageSplit, fits_servers
from dreampipe.planning.sync import Sync, allreduce_terms, replica_groups
from dreampipe.planning.topology import Topology

__all__ = ["RANGES_GRID", "RANGES_MAX_WORKERS", "Copies", "best_ranges", "exact_fits",
           "range_points", "ranges_layers"]

IntArray = npt.NDArray[np.int64]

#: :func:`best_ranges` places stages on every range of up to this many workers; its work
#: grows with their cube.
RANGES_MAX_WORKERS = 32
#: Beyond :data:`RANGES_MAX_WORKERS`, the most ranges of the grid :func:`range_points` lays.
RANGES_GRID = 16
#: The most ``layers^2 x (ranges + 1)^3`` a search on a grid, or on blocks of layers, may
#: take (it weighs about a sixth).
_CANDIDATES = 600_000_000
#: The most a search on every layer and every worker boundary may take: it is exact, so it
#: states no gap and may find a plan far from the grid's (a few seconds at the most).
_EXACT_CANDIDATES = 5_000_000_000
#: The most ``(ranges + 1)^3`` entries per level its table of cut shares may hold (8 bytes
#: each).
_CUT_ENTRIES = 32_000_000


def exact_fits(layers: int, workers: int, runs: int = 1) -> bool:
    """Whether a search of ``layers`` layers on every range of ``workers`` workers, run
    ``runs`` times (under a memory limit, once per count of workers used), fits the
    budgets: the grid's, or the exact search's (AlexNet, VGG-16 and GNMT on 128 workers
    without a memory limit)."""
    every = (workers + 1) ** 3
    work = layers**2 * every
    return (layers > 0 and every <= _CUT_ENTRIES
            and (work <= _CANDIDATES or work * runs <= _EXACT_CANDIDATES))


def range_points(workers: int, layers: int = 0, runs: int = 1) -> tuple[int, ...]:
    """The worker boundaries a stage may start or end at: all of ``0..workers`` up to
    :data:`RANGES_MAX_WORKERS` workers, or beyond when ``layers`` fit a search on every
    range (:func:`exact_fits`; the search is then exact); else the multiples of the least
    ``g`` that leaves at most :data:`RANGES_GRID` ranges, and ``workers``."""
    if workers <= RANGES_MAX_WORKERS or exact_fits(layers, workers, runs):
        return tuple(range(workers + 1))
    step = -(-workers // RANGES_GRID)
    return (*range(0, workers, step), workers)


def ranges_layers(ranges: int) -> int:
    """The most layers :func:`best_ranges` searches on ``ranges`` ranges (workers, or grid
    ranges) within its budget: 129 layers on 32, 349 on 16."""
    return max(2, math.isqrt(_CANDIDATES // (ranges + 1) ** 3))


@dataclass(frozen=True)
class Copies:
    """One server's pipeline run on the same workers of the first ``servers`` servers of
    ``topology`` (:func:`best_ranges`)."""

    topology: Topology
    servers: int

    def place(self, workers: Sequence[int]) -> list[int]:
        """``workers`` of one server, on every server of the copies, in rank order."""
        size = self.topology.levels[0].count
        return [u * size + w for u in range(self.servers) for w in workers]


@dataclass(frozen=True)
class _Option:
    """One way to run a stage: unsplit (``split`` None) or split as ``split`` says.

    Layers ``i..j`` on grid range ``[a, b)`` take ``times[layout[a, b], i, j]``, or
    ``again[...]`` when they recompute (one more forward, before the all-reduce's
    gradients: ``max(C + F, 2F + end)``); ranges of the same layout share a table, and a
    range the option cannot sit on has the last layout, all ``inf``. ``replicas[a, b]``
    counts its replicas there.
    """

    split: StageSplit | None
    times: FloatArray
    again: FloatArray
    layout: IntArray
    replicas: IntArray


def _option(prof: RangeCosts, topo: Topology, sync: Sync, points: IntArray,
            split: StageSplit | None, copies: Copies | None = None) -> _Option:
    """:class:`_Option` of ``split`` on the grid ``points`` (with ``copies``, each range
    on the same workers of that many servers of the whole topology)."""
    t = 1 if split is None else split.t
    whole = topo if copies is None else copies.topology
    costs = prof if split is None else split.costs
    k, n = len(points), prof.n
    layouts: dict[tuple[tuple[int, ...], int], int] = {}
    index = np.full((k, k), -1, dtype=np.int64)
    replicas = np.ones((k, k), dtype=np.int64)
    for a in range(k - 1):
        for b in range(a + 1, k):
            s, e = int(points[a]), int(points[b])
            if t > 1 and not fits_servers(s, e, t, topo):
                continue
            firsts = range(s, e, t) if copies is None else copies.place(range(s, e, t))
            key = (replica_groups(firsts, whole),
                   (e - s) // t * (1 if copies is None else copies.servers))
            index[a, b] = layouts.setdefault(key, len(layouts))
            replicas[a, b] = (e - s) // t
    index[index < 0] = len(layouts)
    never = np.full((1, n, n), np.inf)
    if not layouts:
        return _Option(split, never, never, index, replicas)
    terms = np.array([allreduce_terms(g, whole.levels, sync, p) for g, p in layouts])
    ends = costs.allreduce_ends(terms[:, 0], terms[:, 1], overlap=topo.overlap)
    ends[(terms == 0.0).all(axis=1)] = 0.0
    count = np.array([p for _, p in layouts], dtype=np.float64)
    f = costs.forward
    times = np.stack([stage_time(costs.compute_s, f, ends[x], 1) / count[x]
                      for x in range(len(layouts))])
    again = np.stack([stage_time(costs.compute_s + f, 2 * f, ends[x], 1) / count[x]
                      for x in range(len(layouts))])
    return _Option(split, np.concatenate([times, never]), np.concatenate([again, never]),
                   index, replicas)


@dataclass(frozen=True)
class _Cuts:
    """The cuts between ranges: ``shares [a, b, c, level]`` of the pairs of workers of
    ``[points[a], points[b])`` and ``[points[b], points[c])`` that meet at each level, and
    per level its latency and seconds per cut byte; :meth:`at` prices a slice of them."""

    shares: FloatArray
    latency: tuple[float, ...]
    per_byte: tuple[float, ...]
    cut_bytes: FloatArray
    copies: int = 1

    @classmethod
    def of(cls, prof: RangeCosts, topo: Topology, points: IntArray, copies: int = 1) -> _Cuts:
        return cls(contiguous_cut_shares(topo, points.tolist()),
                   tuple(lv.latency for lv in topo.levels),
                   tuple(1.0 / lv.bandwidth for lv in topo.levels),
                   np.asarray(prof.cut_bytes[:prof.n], dtype=np.float64), copies)

    def at(self, a: slice, b: int, c: slice, t: slice) -> FloatArray:
        """``[a, c, t]``: the cut before layer ``t`` between ``[a, b)`` and ``[b, c)``,
        its slowest level's ``2 (latency + share x bytes / bandwidth)``."""
        phi = self.shares[a, b, c]
        data = self.cut_bytes[t]
        out = np.zeros((*phi.shape[:2], len(data)))
        for x, (lat, per) in enumerate(zip(self.latency, self.per_byte, strict=True)):
            share = phi[..., x, None]
            term = 2 * (lat + share * data * per)
            np.maximum(out, np.where(share > 0, term, 0.0), out=out)
        # copies: replicas are dealt server by server (``pricing.price_stages``), so
        # minibatch m goes from a stage's replica on server m % k to the next's there
        return out / self.copies if self.copies > 1 else out


def best_ranges(
    prof: RangeCosts, topo: Topology, sync: Sync, allow_fewer: bool,
    memory_bytes: int | None = None, points: Sequence[int] | None = None,
    recompute: bool = False, splits: Sequence[StageSplit] = (), copies: Copies | None = None,
) -> tuple[float, list[FlatStage]] | None:
    """The fastest pipeline of stages on contiguous worker ranges laid in order (module doc),
    each starting and ending at one of ``points`` (default: :func:`range_points`), or None
    if none fits in ``memory_bytes`` (None: no limit).

    A stage may also run as any of ``splits``: replicas of ``t`` workers, each inside
    one server (:mod:`dreampipe.planning.split_ranges`), one more choice per stage
    whose terms are table look-ups like the others, so the program stays exact.
    Under a memory limit a stage of ``r`` replicas on ``[s, e)`` of a plan on ``U``
    workers holds ``ceil((r + U - e) / r)`` minibatches, PipeDream's count when no
    split stage follows (:func:`~dreampipe.planning.in_flight.in_flight_counts`), so
    the program runs once per ``U`` and keeps only the stages that fit, recomputing where
    ``recompute`` allows and only the recomputing stage fits (recomputation is never
    faster, so a stage that fits as it is never recomputes). Ties go to an unsplit
    stage, then to the narrower split, to one stage over a split, then to the next stage
    on fewer workers, then to the shorter first stage, and overall to fewer workers in
    the first stage (to fewer in all under a memory limit).

    With ``copies`` the program lays one server's pipeline, ``topo`` that server, and
    prices it run on the same workers of ``copies.servers`` servers of
    ``copies.topology`` (:class:`Copies`): each stage all-reduces over all its copies,
    and each cut, inside the servers, carries ``1 / servers`` of the minibatches.
    """
    at = np.asarray(range_points(topo.num_workers) if points is None else points,
                    dtype=np.int64)
    assert at[0] == 0 and at[-1] == topo.num_workers and (np.diff(at) > 0).all()
    k = len(at) - 1
    options = [_option(prof, topo, sync, at, None, copies)] + [
        _option(prof, topo, sync, at, x, copies) for x in sorted(splits, key=lambda x: x.t)]
    cut = _Cuts.of(prof, topo, at, 1 if copies is None else copies.servers)
    if memory_bytes is None:
        return _placed(_best(options, cut, k if not allow_fewer else None, None), at)
    rooms = [_rooms(prof if o.split is None else o.split.costs, memory_bytes, recompute)
             for o in options]
    found: tuple[float, list[FlatStage]] | None = None
    for used in range(1, k + 1) if allow_fewer else [k]:
        fits = []
        for o, (room, room_again) in zip(options, rooms, strict=True):
            r = o.replicas
            versions = -(-(r + np.maximum(at[used] - at[None, :], 0)) // r)
            fits.append(_Memory(versions, room, o.again, room_again))
        plan = _best(options, cut, used, fits)
        if math.isfinite(plan[0]) and (found is None or plan[0] < found[0]):
            found = plan
    return None if found is None else _placed(found, at)


def _rooms(costs: RangeCosts, memory_bytes: int, recompute: bool
           ) -> tuple[FloatArray, FloatArray | None]:
    return (costs.max_versions(memory_bytes),
            costs.max_versions(memory_bytes, recompute=True) if recompute else None)


def _placed(plan: tuple[float, list[FlatStage]], at: IntArray) -> tuple[float, list[FlatStage]]:
    """``plan``'s stages on the workers its grid ranges stand for."""
    value, flat = plan
    return value, [FlatStage(f.first, f.last,
                             tuple(range(int(at[f.workers[0]]), int(at[f.workers[-1] + 1]))),
                             f.allreduce_s, recompute=f.recompute, split=f.split)
                   for f in flat]


@dataclass(frozen=True)
class _Memory:
    """What fits one option: ``versions [s, e]`` against ``room [i, j]``, else, with
    ``room_again``, the recomputing stage's ``room_again [i, j]`` at its times
    ``again [layout, i, j]``."""

    versions: IntArray
    room: FloatArray
    again: FloatArray
    room_again: FloatArray | None

    def apply(self, plain: FloatArray, again: FloatArray, versions: IntArray,
              i: int | slice, j: int | slice) -> FloatArray:
        """``plain`` where the stage fits as it is, else ``again`` where it fits recomputing,
        else inf (``versions`` broadcast against ``room[i, j]``)."""
        fits = versions <= self.room[i, j]
        out = np.where(fits, plain, np.inf)
        if self.room_again is None:
            return out
        return np.where(~fits & (versions <= self.room_again[i, j]), again, out)


def _stage(options: Sequence[_Option], memory: Sequence[_Memory] | None, s: int | slice,
           e: int | slice, i: int, j: int | slice) -> tuple[FloatArray, IntArray]:
    """The fastest option for layers ``i..j`` on grid ranges ``[s, e)`` that fits, and its
    index (options in order win ties); a slice ``j`` is the trailing axis."""
    best: FloatArray | None = None
    pick = np.zeros((), dtype=np.int64)
    for x, o in enumerate(options):
        lay = o.layout[s, e]
        val = o.times[lay, i, j]
        if memory is not None:
            m = memory[x]
            v = np.asarray(m.versions[s, e])
            v = v[..., None] if isinstance(j, slice) else v
            val = m.apply(val, o.again[lay, i, j], v, i, j)
        if best is None:
            best, pick = val, np.zeros(np.shape(val), dtype=np.int64)
        else:
            better = val < best
            best = np.where(better, val, best)
            pick = np.where(better, x, pick)
    assert best is not None
    return best, pick


def _best(
    options: Sequence[_Option], cut: _Cuts, end: int | None,
    memory: Sequence[_Memory] | None,
) -> tuple[float, list[FlatStage]]:
    """:func:`best_ranges` over grid indices (stage workers ``range(s, e)`` of the grid),
    the last stage ending at grid point ``end`` (None: anywhere) and, given ``memory``,
    only stages that fit (recomputing where it says)."""
    n = options[0].times.shape[1]
    w = options[0].layout.shape[0] - 1
    best = np.full((n, w + 1, w + 1), np.inf)  # H(i, s, e)
    arg_t = np.full((n, w + 1, w + 1), -1, dtype=np.int64)  # -1: one stage to the end
    arg_f = np.zeros((n, w + 1, w + 1), dtype=np.int64)
    valid = np.triu(np.ones((w + 1, w + 1), dtype=bool), 1)
    if end is not None:
        valid[:, np.arange(w + 1) != end] = False
    everywhere = slice(None)
    for i in range(n - 1, -1, -1):
        tail, _ = _stage(options, memory, everywhere, everywhere, i, n - 1)
        best[i] = np.where(valid, tail, np.inf)
        if i == n - 1:
            continue
        for e in range(1, w if end is None else end):
            # candidates [s, t, f]: first stage i..t on [s, e), then the rest on [e, f), f > e
            first, _ = _stage(options, memory, slice(0, e), e, i, slice(i, n - 1))
            link = cut.at(slice(0, e), e, slice(e + 1, None), slice(i + 1, n)
                          ).transpose(0, 2, 1)
            rest = best[i + 1:n, e, e + 1:][None]
            cand = np.maximum(np.maximum(first[:, :, None], link), rest)
            flat = cand.transpose(0, 2, 1).reshape(e, -1)  # [s, (f, t)]: fewer workers first
            pick = np.argmin(flat, axis=1)
            val = flat[np.arange(e), pick]
            better = val < best[i, :e, e]
            best[i, :e, e] = np.where(better, val, best[i, :e, e])
            arg_t[i, :e, e] = np.where(better, i + pick % (n - 1 - i), -1)
            arg_f[i, :e, e] = np.where(better, e + 1 + pick // (n - 1 - i), 0)
    e = min(range(1, w + 1), key=lambda x: (float(best[0, 0, x]), x))
    value = float(best[0, 0, e])
    out, i, s = [], 0, 0
    while True:
        t = int(arg_t[i, s, e])
        last = n - 1 if t < 0 else t
        out.append(_chosen(options, memory, i, last, s, e))
        if t < 0:
            return value, out
        i, s, e = t + 1, e, int(arg_f[i, s, e])


def _chosen(options: Sequence[_Option], memory: Sequence[_Memory] | None, i: int, last: int,
            s: int, e: int) -> FlatStage:
    """The stage ``i..last`` on grid range ``[s, e)`` as the program chose it."""
    _, pick = _stage(options, memory, s, e, i, last)
    x = int(pick)
    o = options[x]
    again = memory is not None and memory[x].room_again is not None and not (
        memory[x].versions[s, e] <= memory[x].room[i, last])
    return FlatStage(i, last, tuple(range(s, e)), 0.0, recompute=bool(again), split=o.split)

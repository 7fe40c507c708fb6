"""What the lower bound's relaxed program knows of a stage, and its cheapest all-reduce.

:class:`BoundStates` describes a stage by its span (the innermost level one of
whose units holds all its workers), an interval of worker counts and, under
the hierarchical ring, a band of the servers its workers sit in; a stage's
all-reduce is priced at :func:`cheapest_terms` of the layouts its state
allows. The servers tie a stage's all-reduce to its cuts: a stage that shares
its servers with the next (both on the same ``c`` servers) all-reduces over
``c`` servers, not over the fewest its workers fill (docs/design.md §4.7).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from dreampipe.planning.costs import FloatArray, RangeCosts
from dreampipe.planning.sync import Sync, SyncKind, allreduce_terms
from dreampipe.planning.topology import Topology

__all__ = ["BoundStates", "cheapest_terms"]

#: Worker counts up to this are their own interval; beyond, intervals grow by a ratio.
EXACT_WORKERS = 16
#: ``(worker interval ratio, server band ratio)`` of the states, finest first
#: (:meth:`BoundStates.within`); the finer, the tighter the bound and the more states.
GRIDS = ((1.06, 1.1), (1.06, 1.25), (1.15, 1.25), (1.15, 1.5), (1.3, 1.5), (1.3, 2.0), (1.6, 3.0))
#: The grid tried first where it fits (:meth:`BoundStates.coarse_to_fine`): few states,
#: and a bound close to the plan on most profiles.
FIRST_GRID = (1.06, 2.0)
#: Servers of at most this many workers have their room tracked (docs/design.md §4.7).
ROOM_MAX = 16


def _hierarchical(topo: Topology, span: int | None, width: int
                  ) -> tuple[FloatArray, FloatArray, np.ndarray, np.ndarray, np.ndarray]:
    """Every ``groups`` tuple the hierarchical ring may lay ``width``-worker replicas on
    (of ``span``, or any): its ``(latency, per byte, prod(g), prod(g[1:]), max(g[1:]))``."""
    levels, counts = topo.levels, [lv.count for lv in topo.levels]
    counts[0] = max(1, counts[0] // width)
    lats, pers, ps, cs, ms = [], [], [], [], []
    for h in range(len(levels)) if span is None else [span]:
        ranges = [np.arange(1, c + 1) if k < h else np.arange(2, c + 1) if k == h
                  else np.ones(1, dtype=np.int64) for k, c in enumerate(counts)]
        grid = [g.ravel() for g in np.meshgrid(*ranges, indexing="ij")]
        lats.append(sum(2 * (g - 1) * lv.latency for g, lv in zip(grid, levels, strict=True)))
        pers.append(sum(2 * (g - 1) / g / lv.bandwidth
                        for g, lv in zip(grid, levels, strict=True)))
        ps.append(np.prod(grid, axis=0))
        cs.append(np.prod(grid[1:], axis=0) if len(grid) > 1 else np.ones_like(grid[0]))
        ms.append(np.max(grid[1:], axis=0) if len(grid) > 1 else np.ones_like(grid[0]))
    return (np.concatenate(lats).astype(np.float64), np.concatenate(pers).astype(np.float64),
            np.concatenate(ps), np.concatenate(cs), np.concatenate(ms))


class _Layouts:
    """The cheapest all-reduce terms of one kind of replica (:func:`cheapest_terms`), for
    any least count of servers, from one pass over the layouts."""

    def __init__(self, topo: Topology, sync: Sync, span: int | None, width: int) -> None:
        self.most = topo.num_workers
        self.tied = sync.kind is SyncKind.HIERARCHICAL
        self._cache: dict[tuple[int, int], tuple[FloatArray, FloatArray]] = {}
        if self.tied:
            self.lat, self.per, self.p, self.c, self.m = _hierarchical(topo, span, width)
            return
        levels, counts = topo.levels, [lv.count for lv in topo.levels]
        counts[0] = max(1, counts[0] // width)
        lat, per = np.full(self.most + 1, np.inf), np.full(self.most + 1, np.inf)
        for h in range(len(levels)) if span is None else [span]:
            g = tuple(2 if k == h else 1 for k in range(len(levels)))
            for p in range(2, math.prod(counts[:h + 1]) + 1):
                x, y = allreduce_terms(g, levels, sync, p)
                lat[p], per[p] = min(lat[p], x), min(per[p], y)
        self._cache[1, 0] = _suffix_minima(lat, per)

    def terms(self, units: int = 1, most: int = 0) -> tuple[FloatArray, FloatArray]:
        """Of replicas on at least ``units`` servers and, where ``most`` is positive, at
        most that many (the ring's and the others' read neither)."""
        key = (units, most) if self.tied else (1, 0)
        if key not in self._cache:
            lat, per = np.full(self.most + 1, np.inf), np.full(self.most + 1, np.inf)
            keep = (self.c >= units) & ((self.m <= most) | (most <= 0))
            np.minimum.at(lat, self.p[keep], self.lat[keep])
            np.minimum.at(per, self.p[keep], self.per[keep])
            self._cache[key] = _suffix_minima(lat, per)
        return self._cache[key]


def _suffix_minima(lat: FloatArray, per: FloatArray) -> tuple[FloatArray, FloatArray]:
    """0 for ``r <= 1``; else the least at ``r`` or beyond: a count beyond ``r`` may be
    laid out more cheaply than ``r`` itself."""
    lat[:2] = per[:2] = 0.0
    lat[1:] = np.minimum.accumulate(lat[1:][::-1])[::-1]
    per[1:] = np.minimum.accumulate(per[1:][::-1])[::-1]
    return lat, per


def cheapest_terms(topo: Topology, sync: Sync, span: int | None = None, width: int = 1,
                   units: int = 1, most: int = 0) -> tuple[FloatArray, FloatArray]:
    """``(latency, per byte)`` of index ``r``: each at most its value on every layout of
    ``r' >= r`` replicas (0 for ``r <= 1``), so non-decreasing in ``r``; with ``span``,
    only of replicas inside one level-``span`` unit and not one level-``span - 1`` unit;
    with ``width`` ``t``, of replicas of ``t`` workers each inside one server; with
    ``units``, of replicas on at least that many servers; with ``most``, on at most that
    many.

    ``replica_groups`` of ``r`` workers has ``g_k <= count_k`` and ``prod(g) >= r``, and
    ``span`` means ``g_k = 1`` above it and ``g_span >= 2`` (for ``span >= 1``); a
    server holds at most ``count_0 // t`` replicas of ``t`` workers, so ``g_0`` is at most
    that; replicas on ``c`` servers have ``prod(g[1:]) >= c`` (each level's group is its
    largest) and ``g_k <= c`` above servers (a level's group counts units that each hold
    one of those servers at least); the least over those tuples is at most any real
    layout's. The hierarchical ring's terms read ``g`` only, the others' ``r`` and the
    outermost level with ``g_k >= 2``, so ``units`` and ``most`` leave theirs as they are.
    """
    return _Layouts(topo, sync, span, width).terms(units, most)


def _unit_bands(lo: int, hi: int, ratio: float) -> list[tuple[int, int]]:
    """``[lo, hi]`` cut into bands of server counts, each to below ``ratio`` times its
    first."""
    out = []
    while lo <= hi:
        end = min(hi, max(lo, math.ceil(lo * ratio) - 1))
        out.append((lo, end))
        lo = end + 1
    return out


class BoundStates:
    """The relaxed program's states (module doc): per state ``q``, its span, its worker
    counts ``[first, last]`` and the servers ``[units_lo, units_hi]`` its workers sit in;
    counts up to :data:`EXACT_WORKERS` are their own interval, larger ones merge while
    the last is at most ``grid[0]`` times the first. States of span 0 come first, and the
    bands of one span and interval are consecutive (``base[q]``: the first of them).
    Servers are banded under the hierarchical ring only, whose terms read them, each band
    below ``grid[1]`` times its first: a state prices its all-reduce at its band's fewest
    servers while a shared cut lets its stage hold up to the most, so narrow bands tie
    the two (docs/design.md §4.7)."""

    def __init__(self, topo: Topology, sync: Sync, widths: Sequence[int],
                 grid: tuple[float, float] = GRIDS[0]) -> None:
        ratio, units_ratio = grid
        #: the grid the states were laid on (:data:`GRIDS`)
        self.grid = grid
        w = topo.num_workers
        self.sizes = [int(x) for x in np.cumprod([lv.count for lv in topo.levels])]
        #: per split width, the layouts of its replicas at any span
        self.any_terms = {t: _Layouts(topo, sync, None, t) for t in widths if t > 1}
        self.span_terms = [_Layouts(topo, sync, k, 1) for k in range(len(topo.levels))]
        change = {1, *self.sizes, *(x + 1 for x in self.sizes)}
        for (lat, per), t in [*((x.terms(), 1) for x in self.span_terms),
                              *((x.terms(), t) for t, x in self.any_terms.items())]:
            r = np.arange(2, w // t + 1)
            moved = (lat[r] != lat[r - 1]) | (per[r] != per[r - 1])
            change.update((t * r[moved]).tolist())
            change.add(t)
        firsts: list[int] = []
        for x in sorted(c for c in change | set(range(1, EXACT_WORKERS + 1)) if c <= w):
            if not firsts or x <= EXACT_WORKERS or x >= firsts[-1] * ratio:
                firsts.append(x)
        lasts = [*(x - 1 for x in firsts[1:]), w]
        banded = sync.kind is SyncKind.HIERARCHICAL and len(self.sizes) > 1
        server = self.sizes[0]
        rows: list[tuple[int, int, int, int, int, int]] = []
        for k, size in enumerate(self.sizes):
            low = 1 if k == 0 else 2
            for a, b in zip(firsts, lasts, strict=True):
                if a <= size and b >= low:
                    a, b = max(a, low), min(b, size)
                    lo, hi = (1, 1) if k == 0 else (max(2, -(-a // server)),
                                                    min(b, size // server))
                    base = len(rows)
                    rows += [(k, a, b, c, d, base)
                             for c, d in (_unit_bands(lo, hi, units_ratio) if banded
                                                 else [(lo, hi)])]
        span, first, last, units_lo, units_hi, bases = (np.array(x, dtype=np.int64)
                                                        for x in zip(*rows, strict=True))
        self.span, self.first, self.last, self.base = span, first, last, bases
        #: per state, the fewest and most servers its workers may sit in
        self.units_lo, self.units_hi = units_lo, units_hi
        #: Workers of one server, tracked by the program where servers are small (else None).
        self.room = self.sizes[0] if len(self.sizes) > 1 and self.sizes[0] <= ROOM_MAX else None

    def fits(self, layers: int, entries: int) -> bool:
        """Whether the program's tables over ``layers`` and these states hold at most
        ``entries`` entries."""
        return layers ** 2 * len(self.first) <= entries

    @classmethod
    def within(cls, topo: Topology, sync: Sync, widths: Sequence[int], layers: int,
               entries: int) -> BoundStates:
        """The finest of :data:`GRIDS` whose states :meth:`fits` ``entries`` (the coarsest
        where none does): a long profile keeps a bound of the all-reduces and cuts on fewer
        states, each looser, rather than lose them."""
        for grid in GRIDS:
            states = cls(topo, sync, widths, grid)
            if states.fits(layers, entries):
                break
        return states

    @classmethod
    def coarse_to_fine(cls, topo: Topology, sync: Sync, widths: Sequence[int], layers: int,
                       entries: int) -> Iterator[BoundStates]:
        """:data:`FIRST_GRID`'s states where they fit ``entries`` (else :meth:`within`'s),
        then the finest of :data:`GRIDS` that fits, where it is another: the caller stops
        once a bound is close enough, so most plans pay for few states."""
        first = cls(topo, sync, widths, FIRST_GRID)
        if first.fits(layers, entries):
            yield first
            finest = cls.within(topo, sync, widths, layers, entries)
            if len(finest.first) > len(first.first) and finest.fits(layers, entries):
                yield finest
            return
        first = cls.within(topo, sync, widths, layers, entries)
        if first.fits(layers, entries):
            yield first

    def work(self, costs: RangeCosts, t: int, overlap: bool, memory_bytes: int | None,
             recompute: bool) -> FloatArray:
        """``[i, j, state]``: ``t max(C, F + end)`` of layers ``i..j`` run by ``t``-worker
        replicas in the state (the cheapest terms of its least replica count on its
        band of servers: of its span unsplit, of any layout split), so that the stage
        takes at least this over its workers; ``inf`` where no replica fits
        ``memory_bytes`` with one minibatch in flight, even recomputing where
        ``recompute`` allows (recomputing adds ``t F``, which
        :mod:`~dreampipe.planning.bound_memory` counts with the memory the stage
        needs)."""
        reps = np.maximum(1, -(-self.first // t))
        lat, per = np.empty(len(reps)), np.empty(len(reps))
        for q, (k, r, c, d) in enumerate(zip(self.span, reps, self.units_lo, self.units_hi,
                                             strict=True)):
            layouts = self.span_terms[k] if t == 1 else self.any_terms[t]
            x, y = layouts.terms(int(c), int(d))
            lat[q], per[q] = x[r], y[r]
        # one pass per distinct pair of terms (bands of one interval often share theirs):
        # -1 marks one replica (no all-reduce), -2 no layout at all
        lat = np.where(reps <= 1, -1.0, np.where(np.isfinite(lat + per), lat, -2.0))
        per = np.where(lat < 0, lat, per)
        pairs, back = np.unique(np.stack([lat, per], axis=1), axis=0, return_inverse=True)
        end = costs.allreduce_ends(np.maximum(pairs[:, 0], 0.0), np.maximum(pairs[:, 1], 0.0),
                                   overlap=overlap)
        end[pairs[:, 0] == -1.0] = 0.0
        end[pairs[:, 0] == -2.0] = np.inf
        c = costs.compute_s[None]
        f = np.minimum(costs.forward, np.where(np.isfinite(costs.compute_s), costs.compute_s,
                                               0.0))[None]
        plain = np.maximum(c, f + end)
        if memory_bytes is not None:
            fits = costs.max_versions(memory_bytes) >= 1
            fits |= (costs.max_versions(memory_bytes, recompute=True) >= 1) & recompute
            plain = np.where(fits[None], plain, np.inf)
        out = plain.transpose(1, 2, 0)[:, :, back.ravel()]
        out[:, :, t > self.last] = np.inf
        out *= t
        return np.asarray(out)

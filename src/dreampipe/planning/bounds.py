"""A lower bound on the fastest plan, so that a heuristic plan can state its gap.

:func:`lower_bound` relaxes every plan of contiguous-layer stages on disjoint
workers, priced as :func:`~dreampipe.planning.pricing.price_stages` prices it
(the hierarchy's plans and the range program's alike), to optimistic terms
of a stage's layers, worker count, span and servers (:class:`BoundStates`):
its all-reduce at the cheapest layout of as many replicas on as many servers,
the cuts around it at the cheapest level and sharing the two stages' counts,
spans and servers allow (:class:`_Cuts`; where a stage across servers meets
stages inside one, the workers it holds in that server leave them less room),
its memory with PipeDream's count of minibatches in flight given the fewest
workers after it (:mod:`~dreampipe.planning.bound_memory`). A plan of time
``P`` gives each stage at least the workers these terms need to reach ``P``,
so when the fewest workers a partition of the layers needs
(:func:`_workers_needed`, a dynamic program over layers and states) exceed
the topology's, no plan reaches ``P``; a bisection finds the largest such
``P``. The argument: docs/design.md §4.7.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from dreampipe.planning.bound_memory import InFlight, Ways, in_flight_terms
from dreampipe.planning.bound_states import GRIDS, BoundStates
from dreampipe.planning.costs import BoolArray, FloatArray, RangeCosts
from dreampipe.planning.split_ranges import StageSplit
from dreampipe.planning.sync import Sync
from dreampipe.planning.topology import Topology

__all__ = ["BOUND_ENTRIES", "fewest_workers", "lower_bound", "work_bound"]

#: The most ``layers^2 x states`` the relaxed program tabulates; beyond it the bound falls
#: back on :func:`work_bound`.
BOUND_ENTRIES = 8_000_000
#: The bisection stops when its bracket is this narrow (the stated gap is that much loose).
_PRECISION = 1e-3
#: A bound within this share of the plan's time says enough: finer states are not tried.
_CLOSE_ENOUGH = 0.02
#: The bisection's first guess lies this share below the plan's time.
_GUESS = 0.05
#: The most cut sizes whose allowed pairs of states :class:`_Cuts` keeps at once.
_PATTERNS = 8


class _Cuts:
    """What any cut before layer ``t`` costs at least, between a stage in state ``q``
    (:class:`BoundStates`: ``x`` workers, span ``s``) and the next in ``q'`` (``y``, ``s'``),
    in ``cut_seconds``' two cases.

    Both stages hold the same ``c`` level-``k`` units: ``2 (alpha_k + a / B_k) / c``. With
    ``s, s' <= k`` each sits in one unit, so ``c = 1`` and ``x + y <= S_k`` (its workers);
    with ``s, s' > k``, ``c >= 2``, ``c >= ceil((x + y) / S_k)``, and ``c <= x, y`` and the
    level-``k`` units of one level-``min(s, s')`` unit, and at most each state's most
    servers; at ``k = 0`` both hold exactly those ``c`` servers, so ``c`` lies in both
    states' bands of servers (what ties a shared cut to the all-reduces,
    :class:`BoundStates`); mixed spans never share. Else every
    pair of their workers carries an equal share, which needs their units to overlap
    below ``m = max(s, s')`` (both then sit in one level-``m`` unit, where every pair
    meets): at most ``S_j / (x + y)`` of the pairs meet inside level-``j`` units, at most
    ``(S_j - y) / x`` where the second stage sits in one of them (and the other way), and
    at most ``(z - 1) / z`` for ``j < m`` if a stage of span ``m`` has ``z`` workers
    (:meth:`_spread_allows`), so levels ``j+1..m`` carry the rest, one at least that over
    their summed bandwidth, and pays one of their latencies.
    """

    def __init__(self, topo: Topology, cut_bytes: FloatArray, states: BoundStates) -> None:
        levels, sizes = topo.levels, states.sizes
        # the single and spread cases read no servers: they are tabulated once per span and
        # interval (``bases``, each the first of its bands) and read through ``group``
        self.bases = np.unique(states.base)
        self.group = np.searchsorted(self.bases, states.base)
        first, last, span = (x[self.bases] for x in (states.first, states.last, states.span))
        bandwidths = np.array([lv.bandwidth for lv in levels])
        #: the least latency of any level: what a cut whose pairs all meet inside pays
        self.alpha = min(lv.latency for lv in levels)
        self.cut_bytes = np.asarray(cut_bytes, dtype=np.float64)
        self._memo: dict[tuple[float, float, int], tuple[list[tuple[BoolArray, float]],
                                                         BoolArray]] = {}
        # per m >= 1 and level j < m (-1: none), ``(S_j, its states' most share held
        # alone, the summed bandwidth of levels j+1..m, their least latency)``: what
        # :meth:`cont` needs to bound the spread case (class doc)
        self.spread: list[list[tuple[float, FloatArray, float, float]]] = [[]]
        for m in range(1, len(levels)):
            # a stage of span m, z workers, has at most z - 1 in any level-(m-1) unit
            outside = np.where(span == m, (last - 1) / last, 1.0)
            self.spread.append([
                (0.0 if j < 0 else float(sizes[j]), outside,
                 float(np.sum(bandwidths[j + 1:m + 1])),
                 min(lv.latency for lv in levels[j + 1:m + 1]))
                for j in range(-1, m)])
        self.first, self.span = first, span
        self.both = first[:, None] + first[None, :]
        wider = np.maximum(span[:, None], span[None, :])
        self.wider = [wider == m for m in range(len(levels))]
        self.one = np.array([2 * (lv.latency + cut_bytes / lv.bandwidth) for lv in levels])
        self.single = [(span <= k)[:, None] & (span <= k)[None, :] & (self.both <= size)
                       for k, size in enumerate(sizes)]
        # the shared case, over every state of span 1 or more (``wide`` of them, the last)
        self.wide = int(np.sum(states.span > 0))
        tail = slice(len(states.span) - self.wide, None)
        span, last = states.span[tail], states.last[tail]
        lo, hi = states.units_lo[tail], states.units_hi[tail]
        both = states.first[tail, None] + states.first[None, tail]
        #: per level, 0 where two states may share its units, else inf; and their most units
        self.shared: list[tuple[FloatArray, np.ndarray]] = []
        for k, size in enumerate(sizes):
            outer = span > k
            most = np.minimum(np.minimum(last, hi), np.array([sizes[s] // size for s in span]))
            least = np.maximum(2, -(-both // size))
            if k == 0:  # the same servers: at least each state's fewest
                least = np.maximum(least, np.maximum(lo[:, None], lo[None, :]))
            allowed = (outer[:, None] & outer[None, :]
                       & (least <= np.minimum(most[:, None], most[None, :])))
            self.shared.append((np.where(allowed, 0.0, np.inf), most))

    def _spread_allows(self, m: int, size: float, p: float) -> tuple[BoolArray, float]:
        """``[q, q']``: whether a spread cut of ``size`` bytes between stages in states
        ``q`` and ``q'`` (``x``, ``y`` workers), meeting inside a level-``m`` unit, may take
        at most ``p``.

        The share of pairs that meet inside level-``j`` units, ``held``, is at most each
        stage's own share (``(z - 1) / z``, span ``m``); at most ``S_j / (x + y)``, as a
        unit holding ``x_u`` and ``y_u`` of them has ``x_u + y_u <= S_j``, so ``x_u y_u <=
        S_j h(x_u, y_u)`` with ``h(a, b) = a b / (a + b)``, concave and of degree 1, hence
        superadditive: ``sum h(x_u, y_u) <= h(x, y)``; and at most ``(S_j - y) / x`` where
        the second sits in one level-``j`` unit (span ``<= j``), which holds all its pairs
        and at most ``S_j - y`` of the first (and the same the other way). The cut takes
        at most ``p`` only if, for every ``j``, ``2 (latency + (1 - held) size /
        bandwidth) <= p`` (a share of 0 away pays the least latency, which ``cont`` checks
        first). Also the least share held inside servers the cut needs (0: none), which
        :meth:`cont` ties to the room a server has left (:meth:`_rooms`).
        """
        first, span, both = self.first, self.span, self.both
        ok = np.ones(both.shape, dtype=bool)
        held = 0.0
        for j, (unit, outside, links, above) in enumerate(self.spread[m], start=-1):
            room = p / 2 - above
            if size <= 0:
                away = math.inf if room >= 0 else 0.0
            else:
                away = max(0.0, room) * links / size * (1 + 1e-9)
            if away >= 1:
                continue
            if j < 0:  # nothing held: all of it goes away
                return np.zeros(both.shape, dtype=bool), 1.0
            least = (1 - away) * (1 - 1e-12)  # the share held that the cut needs
            if j == 0:
                held = least
            alone = outside >= least
            ok &= alone[:, None] & alone[None, :] & (both * least <= unit)
            inner = span <= j
            x, y = first[:, None], first[None, :]
            ok &= ~inner[None, :] | (least * x + y <= unit * (1 + 1e-12))
            ok &= ~inner[:, None] | (x + least * y <= unit * (1 + 1e-12))
        return ok, held

    def cont(self, t: int, need: FloatArray, room: FloatArray | None, p: float
             ) -> tuple[FloatArray, FloatArray | None]:
        """``[q]``: the fewest workers from layer ``t`` on, after a stage in state ``q``
        whose cut before ``t`` takes at most ``p``, given ``need[q']``, the fewest from
        ``t`` on with a first stage in ``q'``; with ``room`` (``[q', rho]``, the same for
        the states of span 0 given ``rho`` workers left in their server), also ``[q,
        rho]``: after a stage of span 0 with ``rho`` workers of its server left.

        A spread cut between a stage of span 0 and one across servers reads the room
        (:meth:`_rooms`)."""
        s = 0 if room is None else room.shape[0]
        spread, allowed = self._pattern(t, p, s)
        least = np.minimum.reduceat(need, self.bases)
        fresh = np.min(np.where(allowed, least[None, :], np.inf), axis=1)
        into, out = self._rooms(spread, least, room)
        np.minimum(fresh, into, out=fresh)
        fresh = fresh[self.group]
        tail = need[len(need) - self.wide:]
        for k, (shared, most) in enumerate(self.shared):
            copies = most >= math.ceil(self.one[k, t] / p * (1 - 1e-12))
            if np.any(copies):
                got = np.min(shared + np.where(copies, tail, np.inf)[None, :], axis=1)
                got[~copies] = np.inf
                np.minimum(fresh[len(need) - self.wide:], got,
                           out=fresh[len(need) - self.wide:])
        if room is None or out is None:
            return fresh, None
        after = np.minimum(fresh[:s, None], out)
        if self.one[0, t] <= p:
            inside = self.single[0][:s, :s]
            same = np.min(np.where(inside[:, :, None], room[None], np.inf), axis=1)
            np.minimum(after, same, out=after)
        return fresh, after

    def _pattern(self, t: int, p: float, s: int
                 ) -> tuple[list[tuple[BoolArray, float]], BoolArray]:
        """:meth:`cont`'s spread cuts and which pairs of states a cut before ``t`` of at
        most ``p`` allows (``s``: the states of span 0 whose rooms are tracked, else 0),
        kept for the cuts of the same size (a model's repeated blocks cut alike)."""
        size = float(self.cut_bytes[t])
        key = (p, size, s)
        if key in self._memo:
            return self._memo[key]
        spread: list[tuple[BoolArray, float]] = []
        if 2 * self.alpha <= p:
            spread = [(self.wider[m] & ok, held) for m in range(1, len(self.wider))
                      for ok, held in [self._spread_allows(m, size, p)]]
        allowed = np.zeros(self.wider[0].shape, dtype=bool)
        for ok, _ in spread:
            allowed[s:, s:] |= ok[s:, s:]
        for k, single in enumerate(self.single):
            if self.one[k, t] <= p and (k > 0 or s == 0):
                allowed |= single
        if len(self._memo) >= _PATTERNS:
            self._memo.clear()
        self._memo[key] = spread, allowed
        return spread, allowed

    def _rooms(self, spread: list[tuple[BoolArray, float]], least: FloatArray,
               room: FloatArray | None) -> tuple[FloatArray, FloatArray | None]:
        """The spread cuts between a stage of span 0 and one across servers, where rooms
        are tracked: ``[q]``, after a stage across servers into one of span 0, and ``[q,
        rho]``, after a stage of span 0 with ``rho`` workers of its server left.

        Every pair that meets inside a server meets in the server ``u`` of the span-0
        stage, so a cut that needs a share ``h`` of the pairs held there needs at least
        ``h y`` of the other stage's ``y`` workers in ``u``. Into ``u``, the span-0 stages
        from there on in ``u`` then have at most ``S_0 - h y`` of its workers: the least
        of ``room`` at that ``rho`` or below counts every such plan. Out of ``u``, those
        workers fit in the ``rho`` the span-0 stages left, which the program counts at
        no less than a plan's own (each stage at no more workers than it holds). The
        argument: docs/design.md §4.7."""
        into = np.full(len(least), np.inf)
        if room is None:
            return into, None
        s, server = room.shape[0], room.shape[1] - 1
        lower = np.minimum.accumulate(room, axis=1)  # the fewest with at most rho left
        rhos = np.arange(server + 1)
        out = np.full((s, server + 1), np.inf)
        for ok, held in spread:
            most = np.floor(server - held * self.first + 1e-9)
            got = lower[:, np.clip(most, 0, server).astype(np.int64)].T  # [q, q']
            got = np.where(ok[:, :s] & (most >= 0)[:, None], got, np.inf)
            np.minimum(into, np.min(got, axis=1), out=into)
            fits = held * self.first[None, :] <= rhos[:, None] + 1e-9  # [rho, q']
            reach = ok[:s, None, :] & fits[None]
            np.minimum(out, np.min(np.where(reach, least[None, None, :], np.inf), axis=2),
                       out=out)
        return into, out


def _workers_needed(work: FloatArray, states: BoundStates, cuts: _Cuts, p: float,
                    workers: int, memory: InFlight | Ways | None = None) -> float:
    """The fewest workers any plan of time at most ``p`` uses, relaxed (module doc): stage
    ``i..j`` on ``x`` workers in state ``q`` takes at least ``work[i, j, q] / x``, and
    ``need[i, q]`` is the fewest from layer ``i`` on with a first stage in ``q``; with
    ``memory``, also what its minibatches in flight need of it, given at least the fewest
    workers after it that the program counts (:class:`InFlight`).

    Where servers are small (``states.room``), ``room[i, q, rho]`` also counts, for a
    first stage of span 0, the ``rho`` workers its server has left for it and the
    stages after it that share the server through their cuts (``x + y + ... <= S_0``).
    """
    n, k = work.shape[0], len(states.first)
    r, s = states.room, int(np.sum(states.span == 0))
    fresh = np.zeros((n + 1, k))
    after = np.zeros((n + 1, s, (r or 0) + 1))
    need = np.full(k, np.inf)
    room = None if r is None else np.full((s, r + 1), np.inf)
    cap = workers + 1.0
    rhos = np.arange((r or 0) + 1)
    lowest = np.zeros((n + 1, k))  # [t, q]: the fewest workers after a stage in q to t - 1
    scale = (1 - 1e-12) / p
    for i in range(n - 1, -1, -1):
        if i + 1 < n:
            fresh[i + 1], got = cuts.cont(i + 1, need, room, p)
            if got is not None:
                after[i + 1] = got
            if memory is not None:
                np.minimum(fresh[i + 1], cap, out=lowest[i + 1])
                if got is not None:
                    np.minimum(lowest[i + 1, :s], np.min(got, axis=1), out=lowest[i + 1, :s])
        x = np.ceil(work[i, i:] * scale)
        np.maximum(x, states.first[None, :], out=x)
        if memory is not None:
            x = memory.fewest(i, x, work, lowest[i + 1:], states.first, scale)
        x[x > states.last[None, :]] = np.inf
        need = np.minimum(cap, np.min(x + fresh[i + 1:], axis=0))
        if room is not None and r is not None:
            xs = x[:, :s, None]  # [last layer, state, rho]: every room at once
            fit = xs <= rhos
            left = np.where(fit, rhos - xs, 0).astype(np.int64)
            rest = np.take_along_axis(after[i + 1:], left, axis=2)
            room = np.minimum(cap, np.min(np.where(fit, xs + rest, np.inf), axis=0))
            need[:s] = room[:, r]
    return float(np.min(need))


def work_bound(fine: RangeCosts, workers: int, splits: Sequence[StageSplit] = (),
               memory_bytes: int | None = None, recompute: bool = False) -> float:
    """The least compute any partition of the layers holds, over ``workers``: a stage on
    ``x`` workers (``r`` replicas of ``t``) takes at least ``C / r = t C / x``, so the
    plan's time times its workers is at least the sum of its stages' ``t C``."""
    options = [(fine, 1), *((s.costs, s.t) for s in splits)]
    least = np.full((fine.n, fine.n), np.inf)
    for costs, t in options:
        c = costs.compute_s
        if memory_bytes is not None:
            fits = costs.max_versions(memory_bytes) >= 1
            fits_again = (costs.max_versions(memory_bytes, recompute=True) >= 1) & recompute
            c = np.where(fits, c, np.where(fits_again, c + costs.forward, np.inf))
        least = np.minimum(least, t * c)
    best = np.zeros(fine.n + 1)
    for i in range(fine.n - 1, -1, -1):
        best[i] = float(np.min(least[i, i:] + best[i + 1:]))
    return float(best[0]) / workers


def lower_bound(fine: RangeCosts, topo: Topology, sync: Sync, above: float,
                splits: Sequence[StageSplit] = (), memory_bytes: int | None = None,
                recompute: bool = False) -> float:
    """A time no plan of ``fine``'s layers on ``topo`` beats (module doc), within
    :data:`_PRECISION` of the relaxation's optimum, at most ``above`` (a plan's time).

    ``splits`` are the tensor splits a stage may run as, ``memory_bytes`` the limit
    every stage must fit and ``recompute`` whether a stage may recompute to fit. The
    relaxation runs on coarse states first (:meth:`BoundStates.coarse_to_fine`) and on
    finer ones only while the bound is more than :data:`_CLOSE_ENOUGH` below ``above``:
    each is a bound, so the largest is, and a plan already known near its optimum costs
    no more than the coarse states' program.
    """
    w = topo.num_workers
    best = work_bound(fine, w, splits, memory_bytes, recompute)
    if not best < above:
        return min(best, above)
    for states in BoundStates.coarse_to_fine(topo, sync, [1, *(s.t for s in splits)], fine.n,
                                             BOUND_ENTRIES):
        best = _relaxed(fine, topo, states, splits, memory_bytes, recompute, best, above)
        if above <= best * (1 + _CLOSE_ENOUGH):
            break
    return best


def fewest_workers(costs: RangeCosts, topo: Topology, sync: Sync, p: float,
                   splits: Sequence[StageSplit] = (), memory_bytes: int | None = None,
                   recompute: bool = False) -> float:
    """At most the fewest workers that any plan of ``costs``' layers on ``topo`` taking at
    most ``p`` uses (the relaxed program on the coarsest states, 0 beyond their budget):
    a search may skip the plans on fewer."""
    states = BoundStates(topo, sync, [1, *(s.t for s in splits)], GRIDS[-1])
    if not states.fits(costs.n, BOUND_ENTRIES):
        return 0.0
    return _program(costs, topo, states, splits, memory_bytes, recompute)(p)


def _program(fine: RangeCosts, topo: Topology, states: BoundStates,
             splits: Sequence[StageSplit], memory_bytes: int | None, recompute: bool
             ) -> Callable[[float], float]:
    """The relaxed program's fewest workers for a time ``p``, its tables made once."""
    w = topo.num_workers
    widths: dict[int, list[RangeCosts]] = {1: [fine]}
    for s in splits:
        widths.setdefault(s.t, []).append(s.costs)
    work: FloatArray | None = None
    tables = []  # per width, kept only where the memory terms read them
    for t, ways in widths.items():
        table = states.work(ways[0], t, topo.overlap, memory_bytes, recompute)
        for costs in ways[1:]:
            np.minimum(table, states.work(costs, t, topo.overlap, memory_bytes, recompute),
                       out=table)
        if memory_bytes is None:
            work = table if work is None else np.minimum(work, table, out=work)
            continue
        tables.append(table)
        work = table.copy() if work is None else np.minimum(work, table, out=work)
    assert work is not None
    cuts = _Cuts(topo, fine.cut_bytes, states)
    memory: InFlight | Ways | None = None
    if memory_bytes is not None:
        # each width's work with its own minibatches in flight (bound_memory.Ways)
        terms = [in_flight_terms([(c, t) for c in ways], memory_bytes, recompute)
                 for t, ways in widths.items()]
        if all(x is not None for x in terms):
            memory = Ways(tuple(zip(tables, terms, strict=True)))
    return lambda p: _workers_needed(work, states, cuts, p, w, memory)


def _relaxed(fine: RangeCosts, topo: Topology, states: BoundStates,
             splits: Sequence[StageSplit], memory_bytes: int | None, recompute: bool,
             lo: float, hi: float) -> float:
    """The relaxed program's least time on ``states``, found by bisection between ``lo``
    (a bound already) and ``hi``; ``lo`` where it is no more. The first guess is
    :data:`_GUESS` below ``hi``: most plans lie that close to their bound, which then
    takes fewer steps."""
    needed = _program(fine, topo, states, splits, memory_bytes, recompute)

    def reaches(p: float) -> bool:
        return needed(p) <= topo.num_workers

    first = True
    while hi > lo * (1 + _PRECISION):
        mid = max(hi / (1 + _GUESS), math.sqrt(lo * hi)) if first else math.sqrt(lo * hi)
        first = False
        if reaches(mid):
            hi = mid
        else:
            lo = mid
    return lo

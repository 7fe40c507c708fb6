"""Pipelines of stages each inside one server, laid server by server in pipeline order.

The hierarchy puts outer stages on whole servers and the range program lays
stages on contiguous workers of a grid, so a pipeline of many narrow stages of
uneven widths (two, four, seven workers: GPT-2 large's blocks on ``dgx-a100:16``)
lies outside both. Here every stage runs, unsplit or split, on workers of one
server (its all-reduce inside it); the stages fill a server in order and the
next that does not fit opens a new one, so each server carries at most one cut
in and one out across servers; a bisection on the time finds the fewest servers
(:func:`_fewest`), and the plan is priced as
:func:`~dreampipe.planning.pricing.price_stages` prices it. A heuristic: it adds
plans to the search and states no gap of its own (docs/design.md §4.7).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dreampipe.planning.costs import FloatArray, RangeCosts, cut_time, stage_time
from dreampipe.planning.level import Options
from dreampipe.planning.plan import Stage
from dreampipe.planning.pricing import price_stages, slowest
from dreampipe.planning.split_ranges import StageSplit
from dreampipe.planning.sync import allreduce_terms
from dreampipe.planning.topology import Topology
from dreampipe.planning.whole_rounds import short

__all__ = ["with_packed"]

#: Bisection steps on the time: the bracket narrows to about 0.5% of the plan's time.
_STEPS = 8
#: The most ``layers^2 x ways x (server slots + 1)`` one pass of :func:`_fewest` may take
#: (GPT-2 large's 219 layers, 22 ways on servers of 8: 9.5 million, a few tenths of a
#: second); beyond, the search is skipped.
_MOST_WORK = 12_000_000
#: What the search multiplies PipeDream's count in flight by, in turn, until the plan holds
#: whole rounds in its memory (:func:`~dreampipe.planning.whole_rounds.short` says where
#: it does not; about three times as many, on GPT-2 large's narrow stages).
_HEADROOM = (1.0, 4.0)


@dataclass(frozen=True)
class _Way:
    """``replicas`` of ``split`` (None: one worker each) inside one server: its times and
    the minibatches its layers hold (``[i, j]``; ``room`` None: no limit)."""

    workers: int
    replicas: int
    split: StageSplit | None
    times: FloatArray
    room: FloatArray | None


def _ways(fine: RangeCosts, topo: Topology, opts: Options, splits: Sequence[StageSplit]
          ) -> list[_Way]:
    """Every way to run a stage inside one server: ``x`` unsplit replicas, or ``r``
    replicas of a split of ``t`` workers with ``r t`` at most the server's workers; each
    all-reduces among its replicas inside the server, as
    :func:`~dreampipe.planning.pricing.price_stages` prices them there."""
    size = topo.levels[0].count
    ones = [1] * (len(topo.levels) - 1)
    out = []
    for costs, t, split in [(fine, 1, None), *((x.costs, x.t, x) for x in splits)]:
        room = None if opts.memory_bytes is None else costs.max_versions(opts.memory_bytes)
        for r in range(1, size // t + 1):
            lat, per = allreduce_terms((r, *ones), topo.levels, opts.sync, r)
            end = np.zeros((costs.n, costs.n)) if r == 1 else costs.allreduce_ends(
                np.array([lat]), np.array([per]), overlap=topo.overlap)[0]
            out.append(_Way(r * t, r, split,
                            stage_time(costs.compute_s, costs.forward, end, r), room))
    return out


def _cuts(fine: RangeCosts, topo: Topology) -> tuple[FloatArray, FloatArray]:
    """``([t], [t])``: the cut before layer ``t`` between stages in one server, and between
    stages on two servers, every pair of their workers meeting above servers (the
    slowest of those levels' terms: the most it costs wherever the two servers sit)."""
    size = fine.cut_bytes[:fine.n]
    inside = cut_time(size, topo.levels[0].bandwidth, topo.levels[0].latency)
    across = np.zeros(fine.n)
    for level in topo.levels[1:]:
        np.maximum(across, cut_time(size, level.bandwidth, level.latency), out=across)
    return inside, across


def _fewest(ways: Sequence[_Way], cuts: tuple[FloatArray, FloatArray], p: float, size: int,
            headroom: float = 1.0) -> tuple[float, list[tuple[int, int, int, bool]]]:
    """The fewest servers, and the stages ``(first, last, way, opens)`` that use them,
    of a pipeline laid server by server in order (``opens``: the stage starts a server),
    whose stages and cuts take at most ``p``, each stage holding its minibatches at
    PipeDream's count with the workers after it counted as every slot left, times
    ``headroom`` (whole rounds in flight hold more: :data:`_HEADROOM`).

    ``g[i, rho]``: the servers still to open for layers ``i..`` with ``rho`` slots left
    in the current one. A cut into a new server is priced across servers, one inside a
    server as such; each server then carries at most one cut in and one out, so its
    links carry no more than one cut across (module doc)."""
    inside, across = cuts
    n = len(inside)
    g = np.full((n + 1, size + 1), math.inf)
    g[n] = 0
    rhos = np.arange(size + 1)
    pick: dict[tuple[int, int], tuple[int, int, bool]] = {}
    for i in range(n - 1, -1, -1):
        opened, open_arg = math.inf, (0, 0)
        stay = np.full(size + 1, math.inf)
        stay_arg = np.zeros((size + 1, 2), dtype=np.int64)
        for w, way in enumerate(ways):
            x, r = way.workers, way.replicas
            fast = way.times[i, i:] <= p  # [j - i]
            # a new server: the servers after, and its slots past this stage
            after = g[i + 1:, size - x]
            ok = fast & np.isfinite(after) & (i == 0 or bool(across[i] <= p))
            if way.room is not None:
                held = headroom * np.ceil((r + np.where(ok, size * after + size - x, 0)) / r)
                ok &= held <= way.room[i, i:]
            got = np.where(ok, after, math.inf)
            j = int(np.argmin(got))
            if got[j] < opened:
                opened, open_arg = float(got[j]), (w, i + j)
            if i == 0 or inside[i] > p:
                continue
            # the same server, ``rho >= x`` slots left: [j - i, rho]
            left = np.clip(rhos - x, 0, size)
            then = g[i + 1:][:, left]
            ok2 = fast[:, None] & np.isfinite(then) & (rhos >= x)[None, :]
            if way.room is not None:
                held2 = headroom * np.ceil((r + np.where(ok2, size * then + left[None, :], 0)) / r)
                ok2 &= held2 <= way.room[i, i:][:, None]
            got2 = np.where(ok2, then, math.inf)
            js = np.argmin(got2, axis=0)
            val = got2[js, rhos]
            better = val < stay
            stay = np.where(better, val, stay)
            stay_arg[better, 0] = w
            stay_arg[better, 1] = (i + js)[better]
        g[i] = np.minimum(stay, 1 + opened)
        for rho in range(size + 1):
            if 1 + opened <= stay[rho]:
                pick[i, rho] = (*open_arg, True)
            else:
                pick[i, rho] = (int(stay_arg[rho, 0]), int(stay_arg[rho, 1]), False)
    out: list[tuple[int, int, int, bool]] = []
    if not math.isfinite(g[0, 0]):
        return math.inf, out
    i, rho = 0, 0
    while i < n:
        w, j, opens = pick[i, rho]
        out.append((i, j, w, opens))
        rho = (size if opens else rho) - ways[w].workers
        i = j + 1
    return float(g[0, 0]), out


def _placed(layout: Sequence[tuple[int, int, int, bool]], ways: Sequence[_Way], size: int
            ) -> list[list[int]]:
    """Each stage's workers: the next free slots of its server, of a new one where it
    opens one."""
    out, server, slot = [], -1, 0
    for _, _, w, opens in layout:
        if opens:
            server, slot = server + 1, 0
        x = ways[w].workers
        out.append(list(range(server * size + slot, server * size + slot + x)))
        slot += x
    return out


def with_packed(fine: RangeCosts, topo: Topology, stages: tuple[Stage, ...], opts: Options,
                splits: Sequence[StageSplit] = ()) -> tuple[Stage, ...]:
    """``stages``, or the pipeline laid server by server (module doc), its stages unsplit
    or run as any of ``splits``, where it fits and is strictly faster.

    Searched only with workers allowed to idle, on two levels or more, without
    ``straight`` or a stage cap, within :data:`_MOST_WORK`; ``stages``' time tops the
    bisection."""
    size = topo.levels[0].count
    count = size + sum(size // x.t for x in splits)  # the ways of a stage in one server
    if (len(topo.levels) < 2 or not opts.allow_fewer or opts.straight or opts.limited
            or fine.n ** 2 * count * (size + 1) > _MOST_WORK):
        return stages
    ways = _ways(fine, topo, opts, splits)
    cuts = _cuts(fine, topo)
    servers = topo.num_workers // size
    best = slowest(stages)
    lo, hi = best / 2, best
    found = stages
    for _ in range(_STEPS):
        mid = math.sqrt(lo * hi)
        plan = None
        for headroom in _HEADROOM:
            used, layout = _fewest(ways, cuts, mid, size, headroom)
            if used > servers:
                break
            priced = price_stages(fine, topo, [(i, j) for i, j, *_ in layout],
                                  _placed(layout, ways, size), opts.sync, opts.memory_bytes,
                                  (), [ways[w].split for _, _, w, _ in layout])
            if (opts.memory_bytes is None
                    or max(x.memory_bytes for x in priced) <= opts.memory_bytes) \
                    and not short(priced):  # else replicas wait at each all-reduce
                plan = priced
                break
        if plan is None:
            lo = mid
            continue
        hi = mid
        if slowest(plan) < slowest(found):
            found = plan
    return found

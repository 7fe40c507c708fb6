"""What the planner searches: the hierarchy, the flat model and contiguous worker ranges,
on the profile or, when its tables would be too large, on a coarse copy of it.

:func:`fastest` runs the dynamic program (:mod:`dreampipe.planning.dp`) on each
cost model and :func:`with_ranges` the program over contiguous ranges
(:mod:`dreampipe.planning.ranges`); both search :attr:`Search.costs` and
price what they find on the fine profile with
:func:`~dreampipe.planning.pricing.price_stages`. :func:`search_for` picks
the profile searched: the profile itself, which makes every answer exact
within its search, or blocks of it (:mod:`dreampipe.planning.coarsen`) when
the exact tables would exceed :data:`~dreampipe.planning.coarsen.
TABLE_WORK`; :attr:`Search.coarse` then says the plan may miss the optimum,
by at most :func:`gap_bound`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dreampipe.planning.bounds import lower_bound
from dreampipe.planning.coarsen import block_starts, coarsen, exact_layers
from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.dp import FlatStage, Options, best_plan
from dreampipe.planning.plan import Heuristic, Stage
from dreampipe.planning.pricing import price_stages, slowest
from dreampipe.planning.ranges import (
    Copies,
    best_ranges,
    exact_fits,
    range_points,
    ranges_layers,
)
from dreampipe.planning.split_ranges import StageSplit
from dreampipe.planning.topology import Topology

__all__ = [
    "FLAT_MAX_WORKERS", "Search", "copies_searched", "cost_models", "fastest", "gap_bound",
    "search_for", "searched", "with_copies", "with_fewer_servers", "with_ranges",
]

#: :func:`fastest` also tries the flat model up to this many workers; beyond, a
#: stage spans whole servers out of many and server alignment costs little.
FLAT_MAX_WORKERS = 64


@dataclass(frozen=True)
class Search:
    """The fine profile, the one searched, and where its blocks start (None: the same)."""

    fine: RangeCosts
    costs: RangeCosts
    starts: tuple[int, ...] | None = None

    @property
    def coarse(self) -> bool:
        return self.starts is not None

    def coarse_splits(self, splits: Sequence[StageSplit]) -> list[StageSplit]:
        """``splits`` over the searched profile's blocks (themselves when it is the fine
        one), in the same order."""
        if self.starts is None:
            return list(splits)
        return [replace(x, costs=coarsen(x.costs, self.starts)) for x in splits]

    def refine(self, flat: Sequence[FlatStage]) -> list[FlatStage]:
        """The searched profile's stages as layer ranges of the fine one."""
        if self.starts is None:
            return list(flat)
        ends = [*self.starts[1:], self.fine.n]
        return [replace(f, first=self.starts[f.first], last=ends[f.last] - 1) for f in flat]


def _blocks(fine: RangeCosts, blocks: int) -> Search:
    if fine.n <= blocks:
        return Search(fine, fine)
    starts = tuple(block_starts(fine, blocks))
    return Search(fine, coarsen(fine, starts), starts)


def search_for(fine: RangeCosts, topology: Topology) -> Search:
    """``fine`` itself, or its blocks when its tables on ``topology`` would be too large."""
    return _blocks(fine, exact_layers(topology))


def cost_models(topo: Topology, also_flat: bool) -> list[Topology]:
    """The hierarchical model, and the flat one at the slowest link where it is cheap."""
    if also_flat and len(topo.levels) > 1 and topo.num_workers <= FLAT_MAX_WORKERS:
        return [topo, topo.flat()]
    return [topo]


def _priced(search: Search, topology: Topology, flat: Sequence[FlatStage], opts: Options
            ) -> tuple[Stage, ...]:
    fine = search.refine(flat)
    return price_stages(search.fine, topology, [(f.first, f.last) for f in fine],
                        [f.workers for f in fine], opts.sync, opts.memory_bytes,
                        [f.recompute for f in fine], [f.split for f in fine])


def fastest(
    search: Search, topology: Topology, cost_models: Sequence[Topology], opts: Options
) -> tuple[Stage, ...] | None:
    """The best plan over the ``cost_models``, each priced on ``topology``; None if none fits."""
    found: tuple[Stage, ...] | None = None
    for model in cost_models:
        best = best_plan(search.costs, [model], opts)
        if best is None:
            continue
        stages = _priced(search, topology, best[1], opts)
        if found is None or slowest(stages) < slowest(found):
            found = stages
    return found


def with_ranges(
    search: Search, topology: Topology, stages: tuple[Stage, ...] | None, opts: Options,
    exact: bool = False, recompute: bool = False, splits: Sequence[StageSplit] = (),
) -> tuple[tuple[Stage, ...] | None, tuple[Heuristic, ...]]:
    """``stages``, or the best plan of contiguous worker ranges where that is strictly
    faster; and how the range search was cut short: on blocks of layers (possibly coarser
    than ``search``'s, as :func:`~dreampipe.planning.ranges.ranges_layers` allows, unless
    ``exact``) or on a grid of workers (beyond
    :data:`~dreampipe.planning.ranges.RANGES_MAX_WORKERS`, for profiles too long to search
    on every range, even when ``exact``).
    ``recompute`` lets a stage that fits ``opts.memory_bytes`` only so recompute, and
    ``splits`` lets a stage run split (:mod:`dreampipe.planning.split_ranges`).

    It runs on a hierarchy (on one level only for splits, or to recompute where nothing fits
    without), without ``straight`` (each stage one worker, which the
    hierarchy already places at its best) or a stage cap (the program does not count
    stages: the plan is then the hierarchy's, which puts outer stages on whole servers).
    """
    # on one level the program adds only what the hierarchy lacks: splits, or recomputing
    # stages where no plan fits without them
    flat_ok = splits or (recompute and opts.memory_bytes is not None and stages is None)
    if (len(topology.levels) < 2 and not flat_ok) or opts.straight:
        return stages, ()
    if opts.limited:
        return stages, (Heuristic.WHOLE_SERVERS,)
    n = search.costs.n
    # under a memory limit the program runs once per count of workers used
    runs = topology.num_workers if opts.memory_bytes is not None and opts.allow_fewer else 1
    points = range_points(topology.num_workers, n, runs)
    grid = len(points) < topology.num_workers + 1
    # every layer where the search is exact anyway (every range, within the exact budget)
    every = exact or (not grid and exact_fits(n, topology.num_workers, runs))
    layers = n if every else min(n, ranges_layers(len(points) - 1))
    ranged_search = _blocks(search.fine, layers)
    coarse = ranged_search.coarse_splits(splits)
    found = best_ranges(ranged_search.costs, topology, opts.sync, opts.allow_fewer,
                        opts.memory_bytes, points, recompute, coarse)
    heuristic = ((Heuristic.LAYER_BLOCKS,) if ranged_search.coarse else ()) + (
        (Heuristic.WORKER_GRID,) if grid else ())
    if found is None:
        return stages, heuristic
    fine_of = {id(c): x for c, x in zip(coarse, splits, strict=True)}
    flat = [replace(f, split=None if f.split is None else fine_of[id(f.split)])
            for f in found[1]]
    ranged = _priced(ranged_search, topology, flat, opts)
    # slower than the program's own price of it (its cuts on their own): shared links bind
    if slowest(ranged) > slowest([replace(st, shared_link_s=0.0) for st in ranged]):
        heuristic += (Heuristic.SHARED_LINKS,)
    if stages is None or slowest(ranged) < slowest(stages):
        stages = ranged
    return stages, heuristic


def copies_searched(topology: Topology, opts: Options, recompute: bool) -> bool:
    """Whether :func:`with_copies` searches: then the plan is no proven optimum, as
    recomputing stages replicated over servers otherwise than as one server's pipeline on
    each are searched nowhere (:attr:`~dreampipe.planning.plan.Heuristic.SERVER_COPIES`)."""
    return (opts.memory_bytes is not None and recompute and len(topology.levels) >= 2
            and not opts.straight and not opts.limited)


def with_copies(search: Search, topology: Topology, stages: tuple[Stage, ...] | None,
                opts: Options, recompute: bool = True) -> tuple[Stage, ...] | None:
    """``stages``, or one server's pipeline with recomputing stages run on the same workers
    of every server where that is strictly faster (or ``stages`` is None): under a
    memory limit with ``recompute``, the hierarchy's replicated inner pipelines, which do
    not recompute. Searched only where ``stages`` recompute or are None: where the
    fastest plan found fits without, so do the copies the hierarchy holds.

    The range program lays the server's pipeline
    (:class:`~dreampipe.planning.ranges.Copies`: each stage all-reduces over all its
    copies; a cut, inside the servers, carries ``1 / k`` of the minibatches on ``k``
    servers, as replicas dealt server by server pass each minibatch within one), on as
    many layers and grid points as :func:`with_ranges` would on that server.
    """
    levels = topology.levels
    limit = opts.memory_bytes
    if limit is None or not copies_searched(topology, opts, recompute):
        return stages
    if stages is not None and not any(x.recompute for x in stages):
        return stages  # the plan found needs no recomputing: the hierarchy's copies hold it
    inner = replace(topology, levels=levels[:1])
    size, n = levels[0].count, search.costs.n
    runs = size if opts.allow_fewer else 1
    points = range_points(size, n, runs)
    every = len(points) == size + 1 and exact_fits(n, size, runs)
    layered = _blocks(search.fine, n if every else min(n, ranges_layers(len(points) - 1)))
    copies = Copies(topology, topology.num_workers // size)
    found = best_ranges(layered.costs, inner, opts.sync, opts.allow_fewer, limit, points,
                        True, (), copies)
    if found is None:
        return stages
    flat = [replace(f, workers=tuple(copies.place(f.workers)))
            for f in layered.refine(found[1])]
    priced = price_stages(search.fine, topology, [(f.first, f.last) for f in flat],
                          [f.workers for f in flat], opts.sync, limit,
                          [f.recompute for f in flat])
    fits = max(x.memory_bytes for x in priced) <= limit
    return priced if fits and (stages is None or slowest(priced) < slowest(stages)) else stages


def searched(search: Search, topology: Topology, opts: Options, also_flat: bool = True,
             exact: bool = False, recompute: bool = False, splits: Sequence[StageSplit] = ()
             ) -> tuple[tuple[Stage, ...] | None, tuple[Heuristic, ...]]:
    """The dynamic program's best plan over the :func:`cost_models`, then, ``also_flat``,
    :func:`with_ranges`' and :func:`with_copies`' where faster; and how the searches past
    the program were cut short (None: no plan fits)."""
    stages = fastest(search, topology, cost_models(topology, also_flat), opts)
    if not also_flat:
        return stages, ()
    stages, cut = with_ranges(search, topology, stages, opts, exact, recompute, splits)
    stages = with_copies(search, topology, stages, opts, recompute)
    if copies_searched(topology, opts, recompute):
        cut = (*cut, Heuristic.SERVER_COPIES)
    return stages, cut


def with_fewer_servers(search: Search, topology: Topology, stages: tuple[Stage, ...],
                       opts: Options, also_flat: bool = True, exact: bool = False,
                       recompute: bool = False, splits: Sequence[StageSplit] = ()
                       ) -> tuple[Stage, ...]:
    """``stages``, or the planner's best on the first ``k`` servers (``k`` each power of two
    below the outermost level's count) where that is strictly faster.

    Where ``stages``' cuts share a server's link (:attr:`~dreampipe.planning.plan.
    Heuristic.SHARED_LINKS`), the programs priced each cut on its own, so their optimum
    on every server may lose to a plan on fewer, whose cuts cross fewer server links:
    GNMT on 16x8 runs 9.96 ms a minibatch on all 16 servers, 8.54 ms on 2. A plan on the
    first servers is priced as on the whole cluster: the same workers, links and groups.
    Searched only with workers allowed to idle, without ``straight`` or a stage cap."""
    levels = topology.levels
    if len(levels) < 2 or not opts.allow_fewer or opts.straight or opts.limited:
        return stages
    k = 1
    while k < levels[-1].count:
        sub = replace(topology, levels=(*levels[:-1], replace(levels[-1], count=k)))
        found, _ = searched(search, sub, opts, also_flat, exact, recompute, splits)
        if found is not None and slowest(found) < slowest(stages):
            stages = found
        k *= 2
    return stages


def gap_bound(stages: Sequence[Stage], fine: RangeCosts, topology: Topology, opts: Options,
              splits: Sequence[StageSplit] = (), recompute: bool = False) -> float:
    """How much slower than the optimum ``stages`` are at most: their time over
    :func:`~dreampipe.planning.bounds.lower_bound` of every plan the search could hold
    (any placement, ``splits``, recomputing where ``recompute`` allows), less one."""
    time = slowest(stages)
    bound = lower_bound(fine, topology, opts.sync, time, splits, opts.memory_bytes, recompute)
    return max(0.0, time / bound - 1.0) if bound > 0 else math.inf

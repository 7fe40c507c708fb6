"""A stand-in for a plan that fits its memory only short of whole rounds in flight.

The search checks memory at PipeDream's count, so under a memory limit its plan may
fit only with fewer minibatches in flight than whole rounds need
(:func:`~dreampipe.planning.in_flight.short_of_rounds`). Its replicas then wait for
each other at each all-reduce, which the steady state it was priced by does not hold:
it runs no faster than its price, and often far slower. Plans whose stages all have as
many replicas hold whole rounds at PipeDream's count, so their price holds: the best
straight pipeline, and the best straight pipeline of stages ``w`` workers wide on the
first ``k`` servers (each ``w`` dividing a server and ``k`` the servers' count) copied
on the others. So may the short plan itself with runs of its neighbouring stages
merged, each on the workers of its run (unsplit, or split as one of its stages was),
or none: fewer stages of uneven replicas need fewer minibatches in flight for whole
rounds, each stage recomputing where it must to hold them or where that frees the
memory a binding 1F1B loop needs. The fastest of them
stands in where it is at most :data:`STAND_IN_WITHIN` slower than the short plan's
price; beyond, the short plan is kept with a warning, as a stand-in on many servers
may be far slower than even a short plan runs (docs/design.md §5.2).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator, Sequence

from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.in_flight import in_flight_counts, short_of_rounds
from dreampipe.planning.level import Options
from dreampipe.planning.plan import Stage
from dreampipe.planning.pricing import price_stages, slowest
from dreampipe.planning.search import Search, cost_models, fastest
from dreampipe.planning.split_ranges import StageSplit
from dreampipe.planning.topology import Topology
from dreampipe.quantities import format_bytes

__all__ = ["STAND_IN_WITHIN", "short", "with_whole_rounds"]

log = logging.getLogger(__name__)

#: A plan short of whole rounds gives way to a stand-in at most this much slower than
#: its price. The short plans measured ran at 19% to 91% of their price, all but one at
#: 71% or less, so a stand-in this close is the faster plan but in rare cases
#: (docs/design.md §5.2).
STAND_IN_WITHIN = 0.25
#: Plans of at most this many stages try every way to merge runs of neighbours; longer
#: ones merge one pair of neighbours at a time.
_EVERY_MERGE_UP_TO = 10
#: The most ways (unsplit or split, per merged run) tried for one grouping.
_WAYS = 16


def short(stages: Sequence[Stage]) -> bool:
    """Whether some stage holds fewer minibatches in flight than whole rounds need."""
    return bool(short_of_rounds([x.replicas for x in stages],
                                [x.tensor_parallel for x in stages],
                                [x.in_flight for x in stages]))


def _copied(search: Search, topology: Topology, opts: Options, also_flat: bool, width: int,
            servers: int = 1) -> tuple[Stage, ...] | None:
    """The best straight pipeline of stages ``width`` workers wide on the first ``servers``
    servers, run on the same workers of the others' every ``servers``: each stage has
    ``width`` times the copies' count of replicas (None where none fits)."""
    levels = topology.levels
    narrow = dataclasses.replace(levels[0], count=levels[0].count // width)
    one = dataclasses.replace(topology, levels=(narrow, *levels[1:-1], *(
        (dataclasses.replace(levels[-1], count=servers),) if len(levels) > 1 else ())))
    found = fastest(search, one, cost_models(one, also_flat), opts)
    if found is None:
        return None
    copies = topology.num_workers // (one.num_workers * width)
    per = topology.num_workers // copies

    def workers(w: int) -> list[int]:  # a worker of ``one`` on the whole topology's
        first = w // narrow.count * levels[0].count + w % narrow.count * width
        return [c * per + first + k for c in range(copies) for k in range(width)]

    return price_stages(search.fine, topology, [(x.first, x.last) for x in found],
                        [[v for w in x.workers for v in workers(w)] for x in found],
                        opts.sync, opts.memory_bytes, [x.recompute for x in found])


def _groupings(n: int) -> Iterator[list[range]]:
    """Runs of ``n`` stages to merge: every grouping up to :data:`_EVERY_MERGE_UP_TO`
    stages, else none and one pair at a time."""
    if n <= _EVERY_MERGE_UP_TO:
        for apart in itertools.product((False, True), repeat=n - 1):
            starts = [0, *(i + 1 for i, cut in enumerate(apart) if cut), n]
            yield [range(a, b) for a, b in itertools.pairwise(starts)]
    else:
        yield [range(j, j + 1) for j in range(n)]
        for i in range(n - 1):
            yield [*(range(j, j + 1) for j in range(i)), range(i, i + 2),
                   *(range(j, j + 1) for j in range(i + 2, n))]


def _merged(fine: RangeCosts, topology: Topology, opts: Options, stages: Sequence[Stage],
            splits: Sequence[StageSplit], recompute: bool) -> Iterator[tuple[Stage, ...]]:
    """``stages`` with runs of neighbours merged (module doc) on their stages' workers: a
    run of one as it was, a longer one unsplit or split as one of its stages is (where its
    workers pair up so, :func:`_tiles`), at most :data:`_WAYS` ways a grouping; each at
    its fastest recompute choice (:func:`_fitted`)."""
    assert opts.memory_bytes is not None
    how: list[StageSplit | None] = []
    for x in stages:
        if x.tensor_parallel == 1:
            how.append(None)
            continue
        own = [sp for sp in splits if sp.t == x.tensor_parallel
               and sp.layers(x.first, x.last) == x.splits]
        if not own:
            return
        how.append(own[0])
    if any(not x.workers for x in stages):
        return
    placed = [[w + k for w in x.workers for k in range(x.tensor_parallel)] for x in stages]
    size = topology.levels[0].count
    for groups in _groupings(len(stages)):
        spans = [(stages[g[0]].first, stages[g[-1]].last) for g in groups]
        places = [sorted(w for i in g for w in placed[i]) for g in groups]
        options = [[how[g[0]]] if len(g) == 1 else _ways([how[i] for i in g], places[k], size)
                   for k, g in enumerate(groups)]
        for ways in itertools.islice(itertools.product(*options), _WAYS):
            found = _fitted(fine, topology, opts, spans, places, list(ways), recompute)
            if found is not None:
                yield found


def _ways(how: Sequence[StageSplit | None], workers: Sequence[int], size: int
          ) -> list[StageSplit | None]:
    """How a merged run of stages run ``how`` may run on ``workers``: unsplit, or split as
    one of them is where its workers pair up so."""
    out: list[StageSplit | None] = [None]
    for sp in how:
        if sp is not None and all(sp is not x for x in out) and _tiles(workers, sp.t, size):
            out.append(sp)
    return out


def _tiles(workers: Sequence[int], t: int, size: int) -> bool:
    """Whether sorted ``workers`` are blocks of ``t`` consecutive workers of one server."""
    return len(workers) % t == 0 and all(
        workers[a + t - 1] == workers[a] + t - 1
        and workers[a] // size == workers[a + t - 1] // size
        for a in range(0, len(workers), t))


def _fitted(fine: RangeCosts, topology: Topology, opts: Options,
            spans: Sequence[tuple[int, int]], places: Sequence[Sequence[int]],
            ways: Sequence[StageSplit | None], recompute: bool) -> tuple[Stage, ...] | None:
    """Stages ``spans`` on ``places``, run ``ways``, the fastest of their recompute choices
    (``recompute`` allowing; None where a stage fits neither way): each stage recomputes
    where it holds the minibatches whole rounds need only so, and, where a 1F1B loop
    binds, others may too, as the memory they free lets the loop's stages hold more
    minibatches in flight (:func:`_extra`). Otherwise recomputing only adds time."""
    assert opts.memory_bytes is not None
    widths = [1 if sp is None else sp.t for sp in ways]
    need = in_flight_counts([len(p) // t for p, t in zip(places, widths, strict=True)],
                            0, widths)
    must, may = [], []
    for (first, last), sp, v in zip(spans, ways, need, strict=True):
        costs = fine if sp is None else sp.costs
        plain = costs.memory(first, last, v) <= opts.memory_bytes
        again = recompute and costs.memory(first, last, v, recompute=True) <= opts.memory_bytes
        if not plain and not again:
            return None
        must.append(not plain)
        may.append(plain and again)

    def priced(flags: Sequence[bool]) -> tuple[Stage, ...]:
        return price_stages(fine, topology, spans, places, opts.sync, opts.memory_bytes,
                            flags, ways)

    best = priced(must)
    if slowest(best) > slowest(best, loops=False):
        for flags in _extra(must, may):
            best = min(best, priced(flags), key=slowest)
    return best


#: The most recompute choices beyond the needed ones :func:`_fitted` prices for a plan
#: whose 1F1B loop binds: every one where at most 6 stages may choose.
_EXTRA_CHOICES = 63


def _extra(must: Sequence[bool], may: Sequence[bool]) -> Iterator[list[bool]]:
    """``must`` with more stages of ``may`` recomputing, fewest first, at most
    :data:`_EXTRA_CHOICES`."""
    free = [i for i, m in enumerate(may) if m]
    more = (c for k in range(1, len(free) + 1) for c in itertools.combinations(free, k))
    for chosen in itertools.islice(more, _EXTRA_CHOICES):
        yield [m or i in chosen for i, m in enumerate(must)]


def with_whole_rounds(search: Search, topology: Topology, opts: Options,
                      stages: tuple[Stage, ...], also_flat: bool = True,
                      splits: Sequence[StageSplit] = (), recompute: bool = False
                      ) -> tuple[Stage, ...]:
    """``stages``, or the fastest stand-in (module doc) where ``stages`` are short of whole
    rounds and it is at most :data:`STAND_IN_WITHIN` slower than their price (``splits``:
    the ways ``stages`` may be split; ``recompute``: whether a merged stage may recompute)."""
    if opts.memory_bytes is None or opts.straight or not short(stages):
        return stages
    straight = dataclasses.replace(opts, straight=True)
    size, count = topology.levels[0].count, topology.levels[-1].count
    many = len(topology.levels) > 1
    # the whole topology's pipeline of single workers is the straight pipeline itself
    tried = [fastest(search, topology, cost_models(topology, also_flat), straight),
             *(_copied(search, topology, straight, also_flat, width, servers)
               for servers in (range(1, count + 1) if many else (1,)) if count % servers == 0
               for width in range(1, size + 1) if size % width == 0
               and (width, servers) != (1, count if many else 1)),
             *_merged(search.fine, topology, opts, stages, splits, recompute)]
    found = [x for x in tried if x is not None and not short(x)
             and max(st.memory_bytes for st in x) <= opts.memory_bytes]
    best = min(found, key=slowest, default=None)
    if best is None or slowest(best) > (1 + STAND_IN_WITHIN) * slowest(stages):
        log.warning("the plan found holds too few minibatches in flight for whole rounds in "
                    "%s, so its replicas wait for each other at each all-reduce and it runs "
                    "slower than its %.3f ms a minibatch (no plan of whole rounds within "
                    "%.0f%% of it was found); check it by simulation ('dreampipe plan')",
                    format_bytes(opts.memory_bytes), 1e3 * slowest(stages),
                    100 * STAND_IN_WITHIN)
        return stages
    log.info("the fastest plan found, %.3f ms, is short of whole rounds in %s: keeping "
             "%d stages of %s replicas, %.3f ms", 1e3 * slowest(stages),
             format_bytes(opts.memory_bytes), len(best),
             "-".join(str(x.replicas) for x in best), 1e3 * slowest(best))
    return best

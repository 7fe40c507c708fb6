"""A stand-in for a plan that fits its memory only short of whole rounds in flight.

The search checks memory at PipeDream's count, so under a memory limit its plan may
fit only with fewer minibatches in flight than whole rounds need
(:func:`~dreampipe.planning.in_flight.short_of_rounds`). Its replicas then wait for
each other at each all-reduce, which the steady state it was priced by does not hold:
it runs no faster than its price, and often far slower. Plans whose stages all have as
many replicas hold whole rounds at PipeDream's count, so their price holds: the best
straight pipeline, and one server's best straight pipeline of stages 1, 2, 4, ...
workers wide (each width that divides the server) copied on every server. The
fastest of them stands in where it is at most :data:`STAND_IN_WITHIN` slower than the
short plan's price; beyond, the short plan is kept with a warning, as a stand-in on
many servers may be far slower than even a short plan runs (docs/design.md §5.2).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from dreampipe.planning.in_flight import short_of_rounds
from dreampipe.planning.level import Options
from dreampipe.planning.plan import Stage
from dreampipe.planning.pricing import price_stages, slowest
from dreampipe.planning.search import Search, cost_models, fastest
from dreampipe.planning.topology import Topology
from dreampipe.quantities import format_bytes

__all__ = ["STAND_IN_WITHIN", "short", "with_whole_rounds"]

log = logging.getLogger(__name__)

#: A plan short of whole rounds gives way to a stand-in at most this much slower than
#: its price. The short plans measured ran at 19% to 91% of their price, all but one at
#: 71% or less, so a stand-in this close is the faster plan but in rare cases
#: (docs/design.md §5.2).
STAND_IN_WITHIN = 0.25


def short(stages: Sequence[Stage]) -> bool:
    """Whether some stage holds fewer minibatches in flight than whole rounds need."""
    return bool(short_of_rounds([x.replicas for x in stages],
                                [x.tensor_parallel for x in stages],
                                [x.in_flight for x in stages]))


def _copied(search: Search, topology: Topology, opts: Options, also_flat: bool, width: int
            ) -> tuple[Stage, ...] | None:
    """One server's best straight pipeline of stages ``width`` workers wide, run on the
    same workers of every server: each stage has ``width`` times the servers' count of
    replicas (None where none fits)."""
    levels = topology.levels
    narrow = dataclasses.replace(levels[0], count=levels[0].count // width)
    one = dataclasses.replace(topology, levels=(narrow, *levels[1:-1], *(
        (dataclasses.replace(levels[-1], count=1),) if len(levels) > 1 else ())))
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


def with_whole_rounds(search: Search, topology: Topology, opts: Options,
                      stages: tuple[Stage, ...], also_flat: bool = True
                      ) -> tuple[Stage, ...]:
    """``stages``, or the fastest stand-in (module doc) where ``stages`` are short of whole
    rounds and it is at most :data:`STAND_IN_WITHIN` slower than their price."""
    if opts.memory_bytes is None or opts.straight or not short(stages):
        return stages
    straight = dataclasses.replace(opts, straight=True)
    size = topology.levels[0].count
    # on one level, one server's pipeline of single workers is the straight pipeline itself
    first = 1 if len(topology.levels) > 1 else 2
    tried = [fastest(search, topology, cost_models(topology, also_flat), straight),
             *(_copied(search, topology, straight, also_flat, width)
               for width in range(first, size + 1) if size % width == 0)]
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
             "%d stages of %d replicas each, %.3f ms", 1e3 * slowest(stages),
             format_bytes(opts.memory_bytes), len(best), best[0].replicas,
             1e3 * slowest(best))
    return best

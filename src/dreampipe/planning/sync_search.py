"""The synchronous planner: the fastest update of a global batch over every layout.

:func:`plan_sync` enumerates what couples all stages, outside the dynamic program:
the split ``t`` of a replica, the copies ``d`` of the pipeline (``d`` divides the
global batch ``B``), the microbatch size ``b`` (a divisor of ``B / d``, or
``--microbatch-size``), the schedule and its virtual stages ``v``, and the stage count
``p`` (``d t p`` workers at most). For each, :func:`~dreampipe.planning.sync_dp.
best_stages` finds the exact best cuts and per-stage options. A choice whose stages
cannot hold the weights' state is not made; every other has floors
(:mod:`~dreampipe.planning.sync_choice_floors`), refined in a heap as it comes up, and the
search stops at the first floor above the best time found, the program reading only
stages that could beat it: the plan is the optimum over every choice. ``--layout`` fixes
``t``, ``p`` and optionally ``v``, ZeRO's level and the recomputed blocks, ``d`` filling
the workers. docs/planner.md, "The synchronous objective".
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
from collections.abc import Callable, Iterator

from dreampipe.errors import PlanError
from dreampipe.planning.split_stage import split_widths
from dreampipe.planning.sync_choice_floors import Choice, ChoiceFloors
from dreampipe.planning.sync_choices import (
    SyncOptions,
    copies_tried,
    divisors,
    stage_counts,
)
from dreampipe.planning.sync_dp import StageTerms, best_stages, whole_block_starts
from dreampipe.planning.sync_objective import (
    PipelineKind,
    Slots,
    factor,
    slots,
)
from dreampipe.planning.sync_plan import SyncPlan, SyncStage
from dreampipe.planning.sync_tables import StageTables
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph

__all__ = ["MAX_VIRTUAL_STAGES", "SyncSearch", "plan_sync"]

log = logging.getLogger(__name__)

#: The most virtual stages a worker is searched with: SC21's runs use 2 to 4 (more multiplies
#: the cuts a microbatch crosses and seldom pays).
MAX_VIRTUAL_STAGES = 4
#: Relative margin under which a floor still beats the best time found.
_MARGIN = 1e-9
#: A choice's program reads the band below this times its floor (or the best time, if
#: lower); where it finds no plan below that, that is its floor, and it runs again
#: when that floor comes up.
_GROWTH = 1.25


class SyncSearch(ChoiceFloors):
    """One search: its choices in the order of their floors, each run through the
    program (:class:`~dreampipe.planning.sync_choice_floors.ChoiceFloors` bounds them,
    :class:`~dreampipe.planning.sync_inputs.SearchInputs` holds what they read)."""

    def choices(self, fit: bool = True) -> Iterator[Choice]:
        """Every choice (with ``fit``: whose stages can hold the weights' state), with a
        floor (module doc): ``phi`` times the model's least compute over the stages."""
        for family in self.families(fit):
            yield from family

    def families(self, fit: bool = True) -> Iterator[Iterator[Choice]]:
        """:meth:`choices` in families of one ``(t, d, b, schedule, v)``, each in the order
        of its floors: ``phi / p`` falls as ``p`` grows (ZB-H1's on each side of
        ``p = m``, where its ratio changes), so a family runs from its most stages down."""
        opts, layout, n = self.opts, self.opts.layout, self.inputs.costs.n
        workers = self.topology.num_workers
        widths = [1] + (split_widths(self.topology) if opts.tensor_split else [])
        for t in [layout.t] if layout else widths:
            if not self.options(t):
                continue
            least = self.least_compute(t)
            for d in copies_tried(opts.global_batch, workers, t, layout,
                                  self.topology.levels[0].count):
                per_copy = opts.global_batch // d
                sizes = [opts.microbatch_size] if opts.microbatch_size else divisors(per_copy)
                for b in (x for x in sizes if x is not None and per_copy % x == 0):
                    fewest = self.fewest_stages(t, d, b) if fit else 1
                    stages = [layout.p] if layout else list(
                        range(min(workers // (d * t), n), fewest - 1, -1))
                    m = per_copy // b
                    for kind, v in self._kinds(t):
                        for ps in stage_counts(kind, v, m, n, stages):
                            yield self._family(t, d, b, m, least * b / self.base, kind, v, ps)

    def _family(self, t: int, d: int, b: int, m: int, floor: float, kind: PipelineKind,
                v: int, stages: list[int]) -> Iterator[Choice]:
        for p in stages:
            yield Choice(factor(kind, p, m, v, self.zb_ratio(t)) * floor / (p * v), t, d, b,
                         kind, v, p)

    def _kinds(self, t: int) -> Iterator[tuple[PipelineKind, int]]:
        layout = self.opts.layout
        for kind in self.opts.kinds:
            if kind is PipelineKind.INTERLEAVED:
                wanted = [layout.v] if layout and layout.v else range(2, MAX_VIRTUAL_STAGES + 1)
                yield from ((kind, v) for v in wanted if v >= 2)
            elif not (layout and layout.v and layout.v > 1) and not (
                    kind is PipelineKind.ZB_H1 and t > 1):
                yield kind, 1

    def run(self, choice: Choice, beat: float = math.inf) -> tuple[float, SyncPlan] | None:
        """The best plan of ``choice``, or None where none fits; exact where it is faster
        than ``beat`` (stages whose floor is at least ``beat`` are left out, and the
        tails stop narrowing there); a None is final where :meth:`covers` says no stage
        was left out."""
        found = self.best(choice, beat)
        return None if found is None else (found[0], found[1]())

    def best(self, choice: Choice, beat: float = math.inf
             ) -> tuple[float, Callable[[], SyncPlan]] | None:
        """:meth:`run`'s time, and what makes its plan: a search makes only the best's."""
        c, opts = choice, self.opts
        m = opts.global_batch // (c.d * c.b)
        sl = slots(c.kind, c.p, m, c.v)
        tables = self.tables(c.t, c.d, c.b, c.kind is PipelineKind.ZB_H1)
        width, starts = self._band(c, beat), None
        if opts.whole_blocks:
            starts = whole_block_starts(self.inputs.blocks, sl.count)
            if starts is None:
                return None
            width = max(b - a for a, b in itertools.pairwise((*starts, tables.n)))
        found = best_stages(tables, sl, opts.memory_bytes, width, beat, starts)
        if found is None:
            return None
        value, terms = found
        return value, functools.partial(self._plan, c, sl, tables, value, terms, m)

    def covers(self, choice: Choice, beat: float) -> bool:
        """Whether :meth:`run` with ``beat`` reads every stage, so that when it finds
        nothing no plan of ``choice`` fits. (A plan it finds at ``beat`` or above may still
        not be the best: the tails stop narrowing at ``beat``.)"""
        return self.opts.whole_blocks or self._band(choice, beat) >= self.inputs.costs.n

    def _band(self, c: Choice, beat: float) -> int:
        m = self.opts.global_batch // (c.d * c.b)
        phi = factor(c.kind, c.p, m, c.v, self.zb_ratio(c.t))
        return self.width(c.t, beat / (phi * c.b / self.base))

    def _plan(self, c: Choice, sl: Slots, tables: StageTables, value: float,
              terms: list[StageTerms], m: int) -> SyncPlan:
        return SyncPlan(
            stages=tuple(SyncStage.priced(x, tables, sl.blocks[k])
                         for k, x in enumerate(terms)),
            schedule=c.kind, tensor_parallel=c.t, data_parallel=c.d,
            pipeline=c.p, virtual_stages=c.v, microbatch_size=c.b, microbatches=m,
            global_batch=self.opts.global_batch, time_per_update_s=value,
            profile_batch=self.base, num_layers=tables.n, model=self.graph.model,
            topology=self.topology.describe())


def plan_sync(graph: LayerGraph, topology: Topology, options: SyncOptions) -> SyncPlan:
    """The fastest synchronous plan of ``graph`` on ``topology`` (module doc); a PlanError
    when no choice fits the memory limit."""
    search = SyncSearch(graph, topology, options)
    best: tuple[float, Callable[[], SyncPlan]] | None = None
    tried = 0
    queue = []  # (floor, how refined: 0, 1 envelope, 2 cuts; family, choice, its rest)
    for k, family in enumerate(search.families()):
        first = next(family, None)
        if first is not None:
            queue.append((first.floor, 0, k, first, family))
    if not queue and not any(True for _ in search.choices(fit=False)):
        raise PlanError(
            f"no layout of {graph.model or 'the model'} on {topology.num_workers} workers "
            f"runs a global batch of {options.global_batch}"
            + (f" as {options.layout.text}" if options.layout else "")
            + f" with {', '.join(k.value for k in options.kinds)}: interleaving needs "
            "v >= 2 and microbatches a multiple of p, zb-h1 unsplit stages, and a "
            "microbatch size must divide each copy's share; change the schedule, the "
            "layout or the batch")
    heapq.heapify(queue)
    while queue:
        floor, refined, k, choice, family = heapq.heappop(queue)
        if best is not None and floor >= best[0] * (1 - _MARGIN):
            break
        if refined == 0:  # its family's next floors no lower; refine this one first
            after = next(family, None)
            if after is not None:
                heapq.heappush(queue, (after.floor, 0, k, after, family))
            heapq.heappush(queue, (search.floor(choice), 1, k, choice, family))
            continue
        if refined == 1:  # about to run the program: raise the floor by the cuts first
            heapq.heappush(queue, (search.floor_with_cuts(choice, floor), 2, k, choice, family))
            continue
        tried += 1
        beat = floor * _GROWTH if floor > 0 else math.inf
        beat = beat if best is None else min(beat, best[0])
        found = search.best(choice, beat)  # exact below beat; any plan it finds is a plan
        if found is not None and (best is None or found[0] < best[0]):
            best = found
        settled = found[0] < beat if found is not None else search.covers(choice, beat)
        if not settled and (best is None or beat < best[0] * (1 - _MARGIN)):
            heapq.heappush(queue, (beat, 2, k, choice, family))  # none below beat
    if best is None:
        limit = options.memory_bytes
        raise PlanError(
            f"no synchronous plan of {graph.model or 'the model'} with a global batch of "
            f"{options.global_batch} fits"
            + (f" in {limit / 1e9:.3g} GB per worker" if limit else "")
            + (f" as layout {options.layout.text}" if options.layout else "")
            + (_whole_blocks_hint(search) if options.whole_blocks else "")
            + "; raise --memory, recompute (drop --no-recompute, or -r in --layout), use a "
            "smaller --microbatch-size or more pipeline stages")
    plan = best[1]()
    log.info("synchronous search: %d of the choices run through the program; %s",
             tried, plan.layout)
    if math.isfinite(best[0]):
        return plan
    raise PlanError("the best synchronous plan takes no finite time; check the profile")


def _whole_blocks_hint(search: SyncSearch) -> str:
    """What ``--whole-blocks`` leaves: the stage counts (chunks under interleaving) that
    share the profile's blocks evenly."""
    count = search.block_count
    even = [k for k in range(1, count + 1) if count % k == 0]
    return (f" with whole blocks ({count} blocks share evenly only into "
            f"{', '.join(map(str, even))} stages, p v under interleaving; or drop "
            "--whole-blocks)")

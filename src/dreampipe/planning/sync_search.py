"""The synchronous planner: the fastest update of a global batch over every layout.

:func:`plan_sync` enumerates what couples all stages, outside the dynamic program:
the split ``t`` of a replica, the copies ``d`` of the pipeline (``d`` divides the
global batch ``B``), the microbatch size ``b`` (a divisor of ``B / d``, or
``--microbatch-size``), the schedule and its virtual stages ``v``, and the stage count
``p`` (``d t p`` workers at most). For each, :func:`~dreampipe.planning.sync_dp.
best_stages` finds the exact best cuts and per-stage options. A choice whose stages
cannot hold the weights' state is not made; every other has floors
(:mod:`~dreampipe.planning.sync_floors`), refined in a heap as it comes up, and the
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
from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from dreampipe.errors import PlanError
from dreampipe.planning.costs import FloatArray, RangeCosts
from dreampipe.planning.split_ranges import split_options
from dreampipe.planning.split_stage import split_widths
from dreampipe.planning.state_bytes import profiled_param_bytes
from dreampipe.planning.sync import replica_groups
from dreampipe.planning.sync_choices import (
    ZERO_LEVELS,
    SyncOptions,
    check_whole_blocks,
    copies_tried,
    divisors,
    stage_counts,
)
from dreampipe.planning.sync_dp import StageTerms, best_stages, whole_block_starts
from dreampipe.planning.sync_floors import (
    OptionFloors,
    Reach,
    band_width,
    envelope,
    least_largest,
    least_largest_with_cut,
    least_layers,
    least_stage_sum,
    least_sum,
    option_floors,
    scaled_computes,
)
from dreampipe.planning.sync_links import replica_allreduce_terms
from dreampipe.planning.sync_objective import (
    PipelineKind,
    Slots,
    factor,
    slots,
    zero_bubble_ratio,
)
from dreampipe.planning.sync_plan import SyncPlan, SyncStage
from dreampipe.planning.sync_stage_option import Recompute, StageOption, layer_blocks
from dreampipe.planning.sync_tables import StageTables, TableInputs
from dreampipe.planning.topology import Topology
from dreampipe.planning.zero_terms import SHARDED_LEVEL
from dreampipe.profiling.graph import LayerGraph

__all__ = ["MAX_VIRTUAL_STAGES", "SyncSearch", "plan_sync"]

log = logging.getLogger(__name__)

#: The most virtual stages a worker is searched with (Megatron-LM's runs use a few).
MAX_VIRTUAL_STAGES = 8
#: Relative margin under which a floor still beats the best time found.
_MARGIN = 1e-9
#: A choice's program reads the band below this times its floor (or the best time, if
#: lower); where it finds no plan below that, that is its floor, and it runs again
#: when that floor comes up.
_GROWTH = 1.25


class _Choice(NamedTuple):
    """One choice made outside the program, ordered by its floor."""

    floor: float
    t: int
    d: int
    b: int
    kind: PipelineKind
    v: int
    p: int


class SyncSearch:
    """One search's inputs: the profile with its weights as trained, each ``t``'s stage
    options and each choice's tables, built once."""

    def __init__(self, graph: LayerGraph, topology: Topology, opts: SyncOptions) -> None:
        self.graph, self.topology, self.opts = graph, topology, opts
        self.trained = opts.training.trained(graph)
        blocks = layer_blocks(graph)
        self.inputs = TableInputs(
            self.trained, RangeCosts.of(self.trained), topology, opts.sync, opts.training,
            profiled_param_bytes(graph), blocks, tuple(x.weight_grad_share for x in graph.layers))
        self.base = graph.batch_size or 1
        #: the profile's blocks: recomputing its first that many, a stage recomputes all of its
        self.block_count = len({b for b in blocks if b is not None})
        self.rho = zero_bubble_ratio(graph)
        layout = opts.layout
        n = self.inputs.costs.n
        if layout is not None and layout.p * (layout.v or 1) > n:
            raise PlanError(f"layout {layout.text} cuts {n} layers into "
                            f"{layout.p * (layout.v or 1)} stages; give at most one stage a "
                            "layer: a smaller p or v")
        if layout is not None and layout.recompute_blocks is not None and not any(
                b is not None for b in blocks):
            raise PlanError(f"layout {layout.text} recomputes {layout.recompute_blocks} blocks "
                            f"a stage, but profile {graph.model or 'model'} has no blocks (a "
                            "gpt: profile's transformer layers); drop -r")
        if opts.whole_blocks:
            check_whole_blocks(blocks, layout, graph.model or "model")

    @functools.cache  # noqa: B019 - one search, dropped with it
    def options(self, t: int) -> tuple[StageOption, ...]:
        """Every way a stage may run on replicas of ``t`` workers: the one place that
        lists a stage's choices."""
        splits: list[StageOption | None] = [StageOption()] if t == 1 else [
            StageOption(split=x) for x in split_options(self.trained, self.topology, [t])]
        layout = self.opts.layout
        out: list[StageOption] = []
        for base in splits:
            assert base is not None
            if layout is not None and layout.recompute_blocks is not None:
                out.append(replace(base, recompute=Recompute.BLOCKS,
                                   blocks=layout.recompute_blocks))
                continue
            out.append(base)
            if self.opts.recompute:
                out.append(replace(base, recompute=Recompute.STAGE))
                if layout is not None and self.block_count:  # a small search: weigh it too
                    out.append(replace(base, recompute=Recompute.BLOCKS,
                                       blocks=self.block_count))
        return tuple(out)

    @functools.cache  # noqa: B019 - one search, dropped with it
    def least_compute(self, t: int) -> float:
        """A floor on the sum of a pipeline's ``tau`` for a profiled minibatch, over the
        options on ``t`` workers a replica
        (:func:`~dreampipe.planning.sync_floors.least_layers`)."""
        return least_layers(self.inputs.costs, {o.split for o in self.options(t)})

    @functools.cache  # noqa: B019 - one search, dropped with it
    def least_weights(self, t: int) -> float:
        """A floor on the weight bytes a pipeline's stages hold together on a replica of
        ``t`` workers: each layer's least over the options (stages' weights are sums of
        their layers')."""
        return least_sum(self.inputs.costs, {o.split for o in self.options(t)},
                         lambda c: c.weights)

    @functools.cache  # noqa: B019 - one search, dropped with it
    def envelope(self, t: int) -> FloatArray:
        """:func:`~dreampipe.planning.sync_floors.envelope` of the options on ``t``
        workers a replica, for a profiled minibatch."""
        return envelope(scaled_computes(self.inputs.costs, {o.split for o in self.options(t)}))

    @functools.cache  # noqa: B019 - one search, dropped with it
    def least_stage(self, t: int, count: int) -> float:
        """A floor on the largest ``tau`` of ``count`` stages, for a profiled minibatch."""
        return least_largest(self.reach(t), count, self.least_compute(t) / count)

    @functools.cache  # noqa: B019 - one search, dropped with it
    def reach(self, t: int) -> Reach:
        """:meth:`envelope`'s stages' reach, for :meth:`least_stage`."""
        return Reach(self.envelope(t))

    def width(self, t: int, theta: float) -> int:
        """The most layers a stage of ``t`` workers a replica may hold while its floor
        (:meth:`envelope`, per profiled minibatch) stays below ``theta``."""
        return band_width(self.envelope(t), theta)

    def zero_levels(self, d: int) -> tuple[int, ...]:
        """The ZeRO levels a stage on ``d`` replicas may shard at, each stage choosing its
        own as one more option: the layout's level where it names one, else the
        options' ``zero_levels`` (every level by default); on one replica every level is
        level 0."""
        layout = self.opts.layout
        if layout is not None and layout.zero:
            return (layout.zero,)
        if d < 2:
            return (0,)
        return self.opts.zero_levels if self.opts.zero_levels is not None else ZERO_LEVELS

    @functools.lru_cache(maxsize=8)  # noqa: B019 - one search, dropped with it
    def tables(self, t: int, d: int, b: int, splits_backward: bool) -> StageTables:
        options = [replace(o, zero=z) for o in self.options(t) for z in self.zero_levels(d)]
        return StageTables(self.inputs, options, t, d, b / self.base, splits_backward)

    def choices(self, fit: bool = True) -> Iterator[_Choice]:
        """Every choice (with ``fit``: whose stages can hold the weights' state), with a
        floor (module doc): ``phi`` times the model's least compute over the stages."""
        for family in self.families(fit):
            yield from family

    def families(self, fit: bool = True) -> Iterator[Iterator[_Choice]]:
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
            for d in copies_tried(opts.global_batch, workers, t, layout):
                per_copy = opts.global_batch // d
                sizes = [opts.microbatch_size] if opts.microbatch_size else divisors(per_copy)
                for b in (x for x in sizes if x is not None and per_copy % x == 0):
                    fewest = self._fewest_stages(t, d, b) if fit else 1
                    stages = [layout.p] if layout else list(
                        range(min(workers // (d * t), n), fewest - 1, -1))
                    m = per_copy // b
                    for kind, v in self._kinds(t):
                        for ps in stage_counts(kind, v, m, n, stages):
                            yield self._family(t, d, b, m, least * b / self.base, kind, v, ps)

    def _family(self, t: int, d: int, b: int, m: int, floor: float, kind: PipelineKind,
                v: int, stages: list[int]) -> Iterator[_Choice]:
        for p in stages:
            yield _Choice(factor(kind, p, m, v, self.rho) * floor / (p * v), t, d, b, kind, v, p)

    def _fewest_stages(self, t: int, d: int, b: int) -> int:
        """The fewest stages whose workers can hold the weights' state and one
        microbatch of ``b`` samples: each stage (each chunk within ``1 / v`` of a worker)
        holds its weights' state (:meth:`least_weights`) and, unless it recomputes block
        by block, what its layers keep for a microbatch at least once (a recomputing
        stage holds it while it recomputes), so ``p`` workers hold at least the model's."""
        limit = self.opts.memory_bytes
        if limit is None:
            return 1
        state = self.least_weights(t) * min(self.opts.training.state_per_byte(
            self.inputs.profiled_param_bytes, z, d) for z in self.zero_levels(d))
        return max(1, math.ceil((state + self.least_kept(t) * b / self.base) / limit - 1e-9))

    @functools.cache  # noqa: B019 - one search, dropped with it
    def least_kept(self, t: int) -> float:
        """A floor on the bytes a pipeline's stages keep together for a profiled minibatch
        on a replica of ``t`` workers: each layer's least over the options, none where a
        stage may recompute block by block (it keeps one block's)."""
        options = self.options(t)
        if any(o.recompute is Recompute.BLOCKS for o in options):
            return 0.0
        return least_sum(self.inputs.costs, {o.split for o in options}, lambda c: c.kept)

    def floor(self, c: _Choice) -> float:
        """A floor on the update time of choice ``c`` (the update takes at least its
        pipeline term): ``phi`` times the largest stage's :meth:`least_stage` at the
        microbatch."""
        m = self.opts.global_batch // (c.d * c.b)
        phi = factor(c.kind, c.p, m, c.v, self.rho)
        return max(c.floor, phi * self.least_stage(c.t, c.p * c.v) * c.b / self.base)

    @functools.cache  # noqa: B019 - one search, dropped with it
    def least_taus(self, t: int, d: int, b: int, held: int, p: int, count: int) -> float:
        """A floor on the sum of the ``tau`` of a pipeline's ``count`` stages on ``p``
        workers, ``d`` replicas of ``t`` workers, microbatches of ``b``, each stage holding
        ``held`` or more, within the memory limit
        (:func:`~dreampipe.planning.sync_floors.least_stage_sum`): less the least each
        stage holds besides its layers' (:attr:`least_besides`) and every stage's but the
        first's inputs; level-3 gathers at the cheapest rate of the ``p`` worker blocks."""
        limit, levels, size = self.opts.memory_bytes, self.zero_levels(d), d * t
        f = b / self.base
        if limit is None:
            return self.least_compute(t) * f
        besides, entry = self.least_besides
        if any(o.recompute is Recompute.BLOCKS for o in self.options(t)):
            entry = 0.0  # its floor counts a block's input at the block, a stage's first too
        room = p * limit - count * besides * f - (count - 1) * held * entry * f
        state = [self.opts.training.state_per_byte(self.inputs.profiled_param_bytes, z, d)
                 for z in levels]
        per = 0.0 if SHARDED_LEVEL not in levels else min(replica_allreduce_terms(
            replica_groups(tuple(range(k * size, (k + 1) * size, t)), self.topology), t,
            self.topology, self.opts.sync, d)[1] for k in range(p))
        return least_stage_sum(self.option_floors(t), dict(zip(levels, state, strict=True)),
                               per, f, held, room)

    @functools.cache  # noqa: B019 - one search, dropped with it
    def option_floors(self, t: int) -> tuple[OptionFloors, ...]:
        """Each option's floors on ``t`` workers a replica, layer by layer
        (:func:`~dreampipe.planning.sync_floors.option_floors`)."""
        return tuple(option_floors(self.inputs.costs, o, self.inputs.blocks)
                     for o in self.options(t))

    @functools.cached_property
    def least_besides(self) -> tuple[float, float]:
        """The least a stage holds besides its weights' state and its microbatches' tensors
        (its backward's working set and its sends), and the least input of a stage after
        the first, for a profiled minibatch: every option's are the profile's."""
        costs = self.inputs.costs
        upper = np.triu(np.ones((costs.n, costs.n), dtype=bool))
        entry = float(np.min(costs.cut_bytes[1:])) if costs.n > 1 else 0.0
        return float(np.min(costs.held_besides[upper])), entry

    def floor_with_cuts(self, c: _Choice, floor: float) -> float:
        """:meth:`floor` (given as ``floor``) raised by the cuts: every stage but the last
        adds its cut, at least the least cut between its worker blocks, to its ``tau``;
        :func:`~dreampipe.planning.sync_floors.least_largest_with_cut` at the
        microbatch; and by the memory: ``phi`` times the mean stage's :meth:`least_taus`
        and cut."""
        m = self.opts.global_batch // (c.d * c.b)
        sl = slots(c.kind, c.p, m, c.v, self.rho)
        taus = self.least_taus(c.t, c.d, c.b, min(sl.in_flight), c.p, sl.count)
        if sl.count < 2:
            return max(floor, sl.factor * taus)
        tables = self.tables(c.t, c.d, c.b, c.kind is PipelineKind.ZB_H1)
        cut = min(float(np.min(tables.cut(a, b)[:-1]))
                  for a, b in set(itertools.pairwise(sl.blocks)))
        floor = max(floor, sl.factor * (taus + (sl.count - 1) * cut) / sl.count)
        lo = least_largest_with_cut(self.envelope(c.t), c.b / self.base, cut, sl.count,
                                    floor / sl.factor)
        return max(floor, sl.factor * lo)

    def _kinds(self, t: int) -> Iterator[tuple[PipelineKind, int]]:
        layout = self.opts.layout
        for kind in self.opts.kinds:
            if kind is PipelineKind.INTERLEAVED:
                wanted = [layout.v] if layout and layout.v else range(2, MAX_VIRTUAL_STAGES + 1)
                yield from ((kind, v) for v in wanted if v >= 2)
            elif not (layout and layout.v and layout.v > 1) and not (
                    kind is PipelineKind.ZB_H1 and t > 1):
                yield kind, 1

    def run(self, choice: _Choice, beat: float = math.inf) -> tuple[float, SyncPlan] | None:
        """The best plan of ``choice``, or None where none fits; exact where it is faster
        than ``beat`` (stages whose floor is at least ``beat`` are left out, and the
        tails stop narrowing there); a None is final where :meth:`covers` says no stage
        was left out."""
        c, opts = choice, self.opts
        m = opts.global_batch // (c.d * c.b)
        sl = slots(c.kind, c.p, m, c.v, self.rho)
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
        return value, self._plan(c, sl, tables, value, terms, m)

    def covers(self, choice: _Choice, beat: float) -> bool:
        """Whether :meth:`run` with ``beat`` reads every stage, so that when it finds
        nothing no plan of ``choice`` fits. (A plan it finds at ``beat`` or above may still
        not be the best: the tails stop narrowing at ``beat``.)"""
        return self.opts.whole_blocks or self._band(choice, beat) >= self.inputs.costs.n

    def _band(self, c: _Choice, beat: float) -> int:
        m = self.opts.global_batch // (c.d * c.b)
        phi = factor(c.kind, c.p, m, c.v, self.rho)
        return self.width(c.t, beat / (phi * c.b / self.base))

    def _plan(self, c: _Choice, sl: Slots, tables: StageTables, value: float,
              terms: list[StageTerms], m: int) -> SyncPlan:
        return SyncPlan(
            stages=tuple(SyncStage.priced(x, tables, sl.blocks[k], c.b, self.base)
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
    best: tuple[float, SyncPlan] | None = None
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
        found = search.run(choice, beat)  # exact below beat; any plan it finds is a plan
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
            + "; raise --memory, recompute (drop --no-recompute, or -r in --layout), use a "
            "smaller --microbatch-size or more pipeline stages")
    log.info("synchronous search: %d of the choices run through the program; %s",
             tried, best[1].layout)
    if math.isfinite(best[0]):
        return best[1]
    raise PlanError("the best synchronous plan takes no finite time; check the profile")

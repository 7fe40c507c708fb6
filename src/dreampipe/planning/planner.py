"""The planner's entry points: the fastest plan for a cluster, or the cost of a given one.

:func:`plan_pipeline` runs PipeDream's dynamic program (:mod:`dreampipe.planning.dp`),
the range program (:mod:`dreampipe.planning.ranges`) and the flat problem,
keeps the fastest (:mod:`dreampipe.planning.search`) as a :class:`Plan` with
the predictions for data parallelism, the best straight pipeline and GPipe;
:func:`evaluate_plan` costs a partition given by hand. Every reported time is
:func:`dreampipe.planning.pricing.price_stages` of the plan's layout, so
``evaluate_plan`` of a plan gives back its time.

With no layer plan under a memory limit, stages split over workers
(:mod:`dreampipe.planning.split_stage`, :mod:`dreampipe.planning.split_ranges`);
``pipedream``, ``1f1b-flush`` and ``gpipe`` run plans whose stages have different
split widths (:mod:`dreampipe.runtime.lanes`). See docs/design.md §4, §6, §10.3-§10.4.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

from dreampipe.errors import PlanError
from dreampipe.planning.costs import CostModel, RangeCosts
from dreampipe.planning.dp import Options, best_plan
from dreampipe.planning.evaluate import baselines, evaluate_plan
from dreampipe.planning.in_flight import in_flight_counts
from dreampipe.planning.memory_terms import STATELESS, OptimizerTerms, stage_memory
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.packed import with_packed
from dreampipe.planning.pipedream_costs import pipedream_states
from dreampipe.planning.plan import Heuristic, Plan, Stage
from dreampipe.planning.pricing import slowest
from dreampipe.planning.ranges import RANGES_MAX_WORKERS
from dreampipe.planning.search import (
    FLAT_MAX_WORKERS,
    Search,
    cost_models,
    gap_bound,
    search_for,
    searched,
    with_fewer_servers,
    with_ranges,
)
from dreampipe.planning.split_ranges import split_options
from dreampipe.planning.split_stage import best_split, no_split_reason, split_stage, split_widths
from dreampipe.planning.sync import Sync
from dreampipe.planning.topology import Topology
from dreampipe.planning.whole_rounds import with_whole_rounds
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import format_bytes

__all__ = ["FLAT_MAX_WORKERS", "MAX_LEVEL_UNITS", "PACK_ABOVE", "evaluate_plan", "memory_needs",
           "plan_pipeline"]  # evaluate_plan lives in dreampipe.planning.evaluate

log = logging.getLogger(__name__)

#: The DP's work grows with the square of a level's unit count (seconds at 1024).
MAX_LEVEL_UNITS = 4096
#: A heuristic plan that states a larger gap also tries a pipeline laid server by server
#: (:mod:`dreampipe.planning.packed`), which takes seconds on a few hundred layers; a
#: gap this small already says the plan is near the optimum.
PACK_ABOVE = 0.05


def _least_memory(search: Search, models: Sequence[Topology], opts: Options,
                  ranged: Callable[[Options], bool] | None = None) -> int:
    """Smallest device memory (within 1%) at which some plan fits; ``ranged``: whether the
    range search finds one under those options (its recomputing stages), beside the
    hierarchy's program."""
    prof = search.fine

    def fits(memory: float) -> bool:
        trial = dataclasses.replace(opts, memory_bytes=math.ceil(memory))
        return best_plan(search.costs, models, trial) is not None or (
            ranged is not None and ranged(trial))

    lo = float(np.max(stage_memory(np.diag(prof.weights), np.diag(prof.kept), 1)))
    hi = float(stage_memory(prof.weights[0, -1], prof.kept[0, -1], models[0].num_workers))
    for _ in range(64):  # the guess may be short of what a plan needs: grow it until one fits
        if fits(hi):
            break
        lo, hi = hi, 2 * hi
    while hi > lo * 1.01:
        mid = math.sqrt(lo * hi)
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return math.ceil(hi)


def _needs(search: Search, models: Sequence[Topology], opts: Options,
           ranged: Callable[[Options], bool] | None = None) -> dict[str, int]:
    """Bytes per worker of data parallelism and of the least demanding layer plan (never
    above the whole model on one worker, a plan whenever workers may idle)."""
    dp = search.fine.memory(0, search.fine.n - 1, 1)
    least = _least_memory(search, models, opts, ranged)
    return {"dp": dp, "pipeline": min(dp, least) if opts.allow_fewer else least}


def memory_needs(graph: LayerGraph, topology: Topology,
                 optimizer: OptimizerTerms = STATELESS) -> dict[str, int]:
    """Per-worker bytes of data parallelism (``"dp"``: the whole model on each worker)
    and of the least demanding layer plan (``"pipeline"``, within 1%) on ``topology``,
    under ``optimizer``'s terms."""
    prof = RangeCosts.of(graph, optimizer)
    return _needs(search_for(prof, topology), cost_models(topology, True),
                  PlanOptions().search(prof.n))


def plan_pipeline(graph: LayerGraph, topology: Topology,
                  options: PlanOptions = PlanOptions()) -> Plan:
    """The fastest plan for ``graph`` on ``topology`` under PipeDream's dynamic program.

    ``options`` (:class:`~dreampipe.planning.options.PlanOptions`) bounds the search:
    a memory limit, replication, idle workers, the stage count, the cost model, the
    all-reduce, and what a stage may be (recomputing, split over workers). Without a
    memory limit fit by any layer plan, and with ``tensor_split``, the model runs as
    one stage with every layer split over workers of one server (module doc; else a
    PlanError). ``mixed_splits`` is off by default: the runtime runs a plan only when
    every stage has the same split and split stages have one replica, so ``train``
    and ``Pipeline(plan="auto")`` get the whole-model fallback. ``recompute`` is off
    by default too, so a plan keeps every stage's activations unless asked.
    """
    opts = options
    prof = RangeCosts.of(graph, opts.optimizer)
    if graph.total_ms() <= 0 or float(prof.compute_s[0, -1]) <= 0:
        raise PlanError(
            "every layer of the profile takes 0 ms forward and backward (Input nodes, which "
            "are data loading, count as 0), so every plan takes 0 ms and none is better than "
            "another; profile the model again ('dreampipe profile') or give the layers their "
            "real times"
        )
    if opts.cost_model is CostModel.PIPEDREAM:
        return _plan_pipedream(graph, topology, opts)
    for level in topology.levels:
        if level.count > MAX_LEVEL_UNITS:
            raise PlanError(
                f"topology {topology.shape} has a level of {level.count} units; the planner "
                f"takes at most {MAX_LEVEL_UNITS} per level: describe the cluster as a "
                "hierarchy such as 64x64"
            )
    search_opts = opts.search(prof.n)
    search = Search(prof, prof) if opts.exact else search_for(prof, topology)
    splits = (split_options(graph, topology, split_widths(topology), opts.optimizer)
              if opts.also_flat and opts.mixed_splits and opts.tensor_split else ())
    models = cost_models(topology, opts.also_flat)
    stages, ranged = searched(search, topology, search_opts, opts.also_flat, opts.exact,
                              opts.recompute, splits)
    if stages is not None and Heuristic.SHARED_LINKS in ranged:
        stages = with_fewer_servers(search, topology, stages, search_opts, True,
                                    opts.exact, opts.recompute, splits)
    coarse = (Heuristic.LAYER_BLOCKS,) if search.coarse else ()
    heuristics = tuple(h for h in Heuristic if h in {*coarse, *ranged})
    if stages is None:
        memory_bytes = opts.memory_bytes
        free = dataclasses.replace(search_opts, memory_bytes=None)
        if memory_bytes is None or best_plan(search.costs, models, free) is None:
            raise PlanError(
                f"no plan uses exactly {topology.num_workers} workers on {prof.n} layers "
                f"with straight={opts.straight}, max_stages={opts.max_stages}; allow fewer "
                "workers, allow replication or raise max_stages"
            )
        recomputing = _ranged(search, topology, opts)
        if opts.tensor_split:
            return _split_plan(graph, search, topology, models, search_opts, memory_bytes,
                               recomputing, opts.optimizer)
        need = _needs(search, models, search_opts, recomputing)["pipeline"]
        raise PlanError(
            f"no plan fits in {format_bytes(memory_bytes)} per device; the smallest needs "
            f"about {format_bytes(need)}: raise --memory or profile a smaller minibatch"
        )
    # the search's exact optimum, without the 1F1B loops that only add
    optimum = None if heuristics else slowest(stages, loops=False)
    whole = with_whole_rounds(search, topology, search_opts, stages, opts.also_flat, splits,
                              opts.recompute)
    if whole is not stages:
        heuristics = tuple(h for h in Heuristic if h in {*heuristics, Heuristic.WHOLE_ROUNDS})
        stages = whole
    if slowest(stages) > slowest(stages, loops=False) * (1 + 1e-9):
        heuristics = tuple(h for h in Heuristic if h in {*heuristics, Heuristic.LOOPS})
    if optimum is not None and heuristics:  # the optimum bounds every plan holding whole rounds
        gap = slowest(stages) / optimum - 1.0
    else:
        gap = (gap_bound(stages, prof, topology, search_opts, splits, opts.recompute)
               if heuristics else 0.0)
    if PACK_ABOVE < gap < math.inf and opts.also_flat:  # loose: try one laid server by server
        packed = with_packed(prof, topology, stages, search_opts, splits)
        if packed is not stages:  # the bound holds for every plan: the faster states it too
            gap = max(0.0, slowest(packed) * (1 + gap) / slowest(stages) - 1)
            stages = packed
    if heuristics:
        log.info("%d layers planned with %s: the plan is at most %.1f%% slower than the "
                 "optimum", prof.n, ", ".join(h.value for h in heuristics), 100 * gap)
    result = Plan(
        stages=stages, num_layers=prof.n, batch_size=graph.batch_size, model=graph.model,
        topology=topology.describe(), time_per_minibatch_s=slowest(stages),
        baselines_s=baselines(prof, topology, opts.memory_bytes, opts.sync),
        layer_names=tuple(x.name for x in graph.layers), optimality_gap=gap,
        heuristics=heuristics if gap > 0 else (),
    )
    log.info("planned %s: %s", graph.model or "model", result.config)
    return result


def _ranged(search: Search, topology: Topology, opts: PlanOptions
            ) -> Callable[[Options], bool] | None:
    """Whether the range search, recomputing stages, finds a plan under some options: what
    the least memory a plan needs weighs beside the hierarchy's program, where
    ``opts`` lets stages recompute and the range search is quick (at most
    :data:`~dreampipe.planning.ranges.RANGES_MAX_WORKERS` workers; beyond, the figure is
    the hierarchy's, an upper bound)."""
    if not (opts.also_flat and opts.recompute) or topology.num_workers > RANGES_MAX_WORKERS:
        return None
    return lambda trial: with_ranges(search, topology, None, trial, opts.exact, True)[0] \
        is not None


def _split_plan(
    graph: LayerGraph, search: Search, topology: Topology, models: Sequence[Topology],
    opts: Options, memory_bytes: int, ranged: Callable[[Options], bool] | None = None,
    optimizer: OptimizerTerms = STATELESS,
) -> Plan:
    """One stage split over ``t`` workers of a server, for when no layer plan fits
    (``optimizer``: what the optimizer holds beside the weights)."""
    prof = search.fine
    needs = _needs(search, models, opts, ranged)
    widths = split_widths(topology, all_workers=not opts.allow_fewer)
    found = best_split(graph, topology, memory_bytes, widths, optimizer)
    if found is None:
        raise PlanError(
            f"no plan fits in {format_bytes(memory_bytes)} per device; the smallest needs "
            f"about {format_bytes(needs['pipeline'])} as a layer pipeline, data parallelism "
            f"needs {format_bytes(needs['dp'])} per worker and "
            f"{no_split_reason(graph, topology, widths, optimizer)}: raise --memory, use "
            "servers with more workers (a split stays inside one) or profile a smaller "
            "minibatch"
        )
    log.info("data parallelism needs %s per worker and the smallest layer pipeline about %s, "
             "more than %s: splitting every layer over %d workers",
             format_bytes(needs["dp"]), format_bytes(needs["pipeline"]),
             format_bytes(memory_bytes), found.workers)
    stage = split_stage(graph, found, optimizer)
    result = Plan(
        stages=(stage,), num_layers=prof.n, batch_size=graph.batch_size, model=graph.model,
        topology=topology.describe(), time_per_minibatch_s=stage.compute_s,
        baselines_s=baselines(prof, topology, memory_bytes, opts.sync),
        layer_names=tuple(x.name for x in graph.layers),
    )
    log.info("planned %s: %s", graph.model or "model", result.config)
    return result


def _plan_pipedream(graph: LayerGraph, topology: Topology, options: PlanOptions) -> Plan:
    """:func:`plan_pipeline` under PipeDream's terms, over its states, shown as layer ranges."""
    states = pipedream_states(graph)
    prof = states.costs
    best = best_plan(prof, [topology], options.search(prof.n))
    if best is None:
        raise PlanError(
            f"no plan uses exactly {topology.num_workers} workers on PipeDream's {prof.n} "
            f"states with straight={options.straight}, max_stages={options.max_stages}; "
            "allow replication, raise max_stages or use --cost-model dreampipe"
        )
    value, flat = best
    spans, first = [], 0
    for s, f in enumerate(flat):
        last = len(graph.layers) - 1 if s == len(flat) - 1 else states.last_layer[f.last]
        spans.append((first, last))
        first = last + 1
    empty = [s for s, (i, j) in enumerate(spans) if j < i]
    if empty:  # its states end where an earlier stage's do: they add no layer of their own
        raise PlanError(
            f"PipeDream's best plan over {len(flat)} stages puts stage {empty[0]} on "
            f"states that hold no layer of {graph.model or 'the model'} not already "
            "placed; allow fewer stages (--max-stages, or drop --straight) or use "
            "--cost-model dreampipe")
    replicas = [f.replicas for f in flat]
    firsts = [0, *itertools.accumulate(replicas)]
    counts = in_flight_counts(replicas)
    memories = RangeCosts.of(graph, options.optimizer).memories(spans, counts)
    stages = [
        Stage(first=first, last=last, replicas=f.replicas,
              ranks=tuple(range(firsts[s], firsts[s + 1])),
              compute_s=float(prof.compute_s[f.first, f.last]), allreduce_s=f.allreduce_s,
              memory_bytes=memories[s], in_flight=counts[s])
        for s, ((first, last), f) in enumerate(zip(spans, flat, strict=True))
    ]
    return Plan(
        stages=tuple(stages), num_layers=len(graph.layers), batch_size=graph.batch_size,
        model=graph.model, topology=topology.describe(), time_per_minibatch_s=value,
        baselines_s=baselines(prof, topology, None, Sync(), CostModel.PIPEDREAM),
        layer_names=tuple(x.name for x in graph.layers),
    )

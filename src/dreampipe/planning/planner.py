"""The planner's entry points: the fastest plan for a cluster, or the cost of a given one.

:func:`plan_pipeline` runs PipeDream's dynamic program (:mod:`dreampipe.planning.dp`)
on the topology and reads the winning partition back as a :class:`Plan`,
with the same cost model's predictions for plain data parallelism, the best
straight pipeline and GPipe. :func:`evaluate_plan` costs a partition given by hand.

Every reported time is :func:`dreampipe.planning.pricing.price_stages` of
the plan's layout, so ``evaluate_plan`` of a plan's own stages and workers
gives back its time. The hierarchy forces every outer stage onto whole
servers, so a paper config such as ``15-1`` on 2x8 cannot be expressed;
:func:`plan_pipeline` therefore also searches stages on any contiguous range
of workers (:mod:`dreampipe.planning.ranges`, up to 32 workers) or the flat
problem at the slowest link (up to 64), and keeps whichever is faster
(:mod:`dreampipe.planning.search`). A profile with more layers than the
topology's tables take is searched in blocks of layers, and the plan then
records how far from the optimum it may be (``Plan.optimality_gap``).

``cost_model=CostModel.PIPEDREAM`` runs the same DP on PipeDream's own terms
(:mod:`dreampipe.planning.pipedream_costs`): over its states, hierarchical
only, every worker used, as its optimizer does; the plan's time is its
pipeline time and ``baselines_s["dp"]`` its data-parallel time.

When a memory limit leaves no layer plan, :func:`plan_pipeline` splits every
layer over ``t`` workers of one server instead (operator partitioning,
:mod:`dreampipe.planning.split_stage`): the fastest split that fits, over
``t = 2, 4, ...`` up to a server's workers. With ``mixed_splits`` a split is
instead a per-stage choice of the range search (:mod:`dreampipe.planning.split_ranges`),
of which that fallback is one case. :func:`memory_needs` says what
data parallelism and the least demanding layer plan need per worker.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence

import numpy as np

from dreampipe.errors import PlanError
from dreampipe.planning.costs import CostModel, RangeCosts, stage_memory
from dreampipe.planning.dp import Options, best_plan
from dreampipe.planning.evaluate import baselines, evaluate_plan
from dreampipe.planning.in_flight import in_flight_counts
from dreampipe.planning.pipedream_costs import pipedream_states
from dreampipe.planning.plan import Heuristic, Plan, Stage
from dreampipe.planning.pricing import slowest
from dreampipe.planning.search import (
    FLAT_MAX_WORKERS,
    Search,
    cost_models,
    fastest,
    gap_bound,
    search_for,
    with_ranges,
)
from dreampipe.planning.split_ranges import split_options
from dreampipe.planning.split_stage import best_split, no_split_reason, split_stage, split_widths
from dreampipe.planning.sync import DEFAULT_SYNC, Sync
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import format_bytes

__all__ = ["FLAT_MAX_WORKERS", "MAX_LEVEL_UNITS", "evaluate_plan", "memory_needs",
           "plan_pipeline"]  # evaluate_plan lives in dreampipe.planning.evaluate

log = logging.getLogger(__name__)

#: The DP's work grows with the square of a level's unit count (seconds at 1024).
MAX_LEVEL_UNITS = 4096


def _least_memory(search: Search, models: Sequence[Topology], opts: Options) -> int:
    """Smallest device memory (within 1%) at which some plan fits."""
    prof = search.fine
    lo = float(np.max(stage_memory(np.diag(prof.weights), np.diag(prof.kept), 1)))
    hi = float(stage_memory(prof.weights[0, -1], prof.kept[0, -1], models[0].num_workers))
    while hi > lo * 1.01:
        mid = math.sqrt(lo * hi)
        trial = Options(math.ceil(mid), opts.straight, opts.allow_fewer, opts.slots, opts.limited,
                        opts.model, opts.sync)
        if best_plan(search.costs, models, trial) is None:
            lo = mid
        else:
            hi = mid
    return math.ceil(hi)


def _needs(search: Search, models: Sequence[Topology], opts: Options) -> dict[str, int]:
    """Bytes per worker of data parallelism and of the least demanding layer plan (never
    above the whole model on one worker, a plan whenever workers may idle)."""
    dp, least = search.fine.memory(0, search.fine.n - 1, 1), _least_memory(search, models, opts)
    return {"dp": dp, "pipeline": min(dp, least) if opts.allow_fewer else least}


def memory_needs(graph: LayerGraph, topology: Topology) -> dict[str, int]:
    """Per-worker bytes of data parallelism (``"dp"``: the whole model on each worker)
    and of the least demanding layer plan (``"pipeline"``, within 1%) on ``topology``."""
    opts = Options(None, False, True, 1, False, CostModel.DREAMPIPE, DEFAULT_SYNC)
    return _needs(search_for(RangeCosts.of(graph), topology), cost_models(topology, True), opts)


def _check_slots(max_stages: int | None, n: int) -> int:
    if max_stages is None:
        return 1
    if not 1 <= max_stages <= n:
        raise PlanError(
            f"max_stages={max_stages} is impossible for a model of {n} layers; "
            f"use 1..{n} (a stage holds at least one layer)"
        )
    return max_stages


def plan_pipeline(
    graph: LayerGraph,
    topology: Topology,
    *,
    memory_bytes: int | None = None,
    straight: bool = False,
    allow_fewer_workers: bool = True,
    max_stages: int | None = None,
    also_flat: bool = True,
    cost_model: CostModel = CostModel.DREAMPIPE,
    sync: Sync = DEFAULT_SYNC,
    tensor_split: bool = True,
    exact: bool = False,
    recompute: bool = False,
    mixed_splits: bool = False,
) -> Plan:
    """The fastest plan for ``graph`` on ``topology`` under PipeDream's dynamic program.

    ``memory_bytes`` rejects stages that do not fit (None: no limit, like
    PipeDream's optimizer by default); ``straight`` forbids replication;
    ``allow_fewer_workers`` lets idle workers stay idle when that is faster;
    ``max_stages`` caps the number of stages of the flattened plan;
    ``also_flat`` also solves the one-level problem at the slowest link
    (stages need not align with servers) and keeps it when faster;
    ``sync`` is the all-reduce algorithm of replicated stages;
    ``tensor_split`` lets a model that no layer plan fits in ``memory_bytes``
    run as one stage with every layer split over workers of one server
    (module doc; False: an error instead).
    ``mixed_splits`` makes a tensor split a per-stage choice of the range search
    (:mod:`dreampipe.planning.split_ranges`; with ``tensor_split``): any stage may run
    as replicas split over 2, 4... workers of one server where that is faster or the
    only way to fit, beside unsplit and recomputing stages. Off by default: the runtime
    runs a plan only when every stage has the same split and split stages have one
    replica, so ``train`` and ``Pipeline(plan="auto")`` get the whole-model fallback.
    ``recompute`` lets a stage recompute its activations in the backward where
    only that fits ``memory_bytes`` (one more forward; the range search's choice,
    :func:`~dreampipe.planning.ranges.best_ranges`; off by default, so a plan keeps
    every stage's activations unless asked; the runtime runs either).
    ``exact`` searches every layer however long it takes (default: a profile
    longer than the topology's tables take, :func:`~dreampipe.planning.coarsen.
    exact_layers`, is searched in blocks and the plan records its
    ``optimality_gap``).
    ``cost_model`` picks the terms; ``PIPEDREAM`` reproduces PipeDream's
    optimizer, which plans hierarchically on every worker without a memory
    limit, so it ignores ``also_flat``, ``allow_fewer_workers`` and ``sync``.
    """
    prof = RangeCosts.of(graph)
    if graph.total_ms() <= 0 or float(prof.compute_s[0, -1]) <= 0:
        raise PlanError(
            "every layer of the profile takes 0 ms forward and backward (Input nodes, which "
            "are data loading, count as 0), so every plan takes 0 ms and none is better than "
            "another; profile the model again ('dreampipe profile') or give the layers their "
            "real times"
        )
    if cost_model is CostModel.PIPEDREAM:
        return _plan_pipedream(graph, topology, memory_bytes, straight, max_stages)
    for level in topology.levels:
        if level.count > MAX_LEVEL_UNITS:
            raise PlanError(
                f"topology {topology.shape} has a level of {level.count} units; the planner "
                f"takes at most {MAX_LEVEL_UNITS} per level: describe the cluster as a "
                "hierarchy such as 64x64"
            )
    if memory_bytes is not None and memory_bytes <= 0:
        raise PlanError(f"memory_bytes={memory_bytes} must be positive, e.g. 16e9 for 16 GB")
    opts = Options(memory_bytes, straight, allow_fewer_workers, _check_slots(max_stages, prof.n),
                   max_stages is not None, CostModel.DREAMPIPE, sync)
    search = Search(prof, prof) if exact else search_for(prof, topology)
    models = cost_models(topology, also_flat)
    stages = fastest(search, topology, models, opts)
    heuristics: tuple[Heuristic, ...] = (Heuristic.LAYER_BLOCKS,) if search.coarse else ()
    if also_flat:
        splits = (split_options(graph, topology, split_widths(topology))
                  if mixed_splits and tensor_split else ())
        stages, ranged = with_ranges(search, topology, stages, opts, exact, recompute, splits)
        heuristics = tuple(h for h in Heuristic if h in {*heuristics, *ranged})
    if stages is None:
        free = Options(None, straight, allow_fewer_workers, opts.slots, opts.limited,
                       CostModel.DREAMPIPE, sync)
        if memory_bytes is None or best_plan(search.costs, models, free) is None:
            raise PlanError(
                f"no plan uses exactly {topology.num_workers} workers on {prof.n} layers "
                f"with straight={straight}, max_stages={max_stages}; allow fewer workers, "
                "allow replication or raise max_stages"
            )
        if tensor_split:
            return _split_plan(graph, search, topology, models, opts, memory_bytes)
        need = _needs(search, models, opts)["pipeline"]
        raise PlanError(
            f"no plan fits in {format_bytes(memory_bytes)} per device; the smallest needs "
            f"about {format_bytes(need)}: raise --memory or profile a smaller minibatch"
        )
    gap = gap_bound(stages, prof, topology.num_workers) if heuristics else 0.0
    if heuristics:
        log.info("%d layers planned with %s: the plan is at most %.1f%% slower than the "
                 "optimum", prof.n, ", ".join(h.value for h in heuristics), 100 * gap)
    result = Plan(
        stages=stages, num_layers=prof.n, batch_size=graph.batch_size, model=graph.model,
        topology=topology.describe(), time_per_minibatch_s=slowest(stages),
        baselines_s=baselines(prof, topology, memory_bytes, sync),
        layer_names=tuple(x.name for x in graph.layers), optimality_gap=gap,
        heuristics=heuristics if gap > 0 else (),
    )
    log.info("planned %s: %s", graph.model or "model", result.config)
    return result


def _split_plan(
    graph: LayerGraph, search: Search, topology: Topology, models: Sequence[Topology],
    opts: Options, memory_bytes: int,
) -> Plan:
    """One stage split over ``t`` workers of a server, for when no layer plan fits."""
    prof = search.fine
    needs = _needs(search, models, opts)
    widths = split_widths(topology, all_workers=not opts.allow_fewer)
    found = best_split(graph, topology, memory_bytes, widths)
    if found is None:
        raise PlanError(
            f"no plan fits in {format_bytes(memory_bytes)} per device; the smallest needs "
            f"about {format_bytes(needs['pipeline'])} as a layer pipeline, data parallelism "
            f"needs {format_bytes(needs['dp'])} per worker and "
            f"{no_split_reason(graph, topology, widths)}: raise --memory, use servers with more "
            "workers (a split stays inside one) or profile a smaller minibatch"
        )
    log.info("data parallelism needs %s per worker and the smallest layer pipeline about %s, "
             "more than %s: splitting every layer over %d workers",
             format_bytes(needs["dp"]), format_bytes(needs["pipeline"]),
             format_bytes(memory_bytes), found.workers)
    stage = split_stage(graph, found)
    result = Plan(
        stages=(stage,), num_layers=prof.n, batch_size=graph.batch_size, model=graph.model,
        topology=topology.describe(), time_per_minibatch_s=stage.compute_s,
        baselines_s=baselines(prof, topology, memory_bytes, opts.sync),
        layer_names=tuple(x.name for x in graph.layers),
    )
    log.info("planned %s: %s", graph.model or "model", result.config)
    return result


def _plan_pipedream(
    graph: LayerGraph, topology: Topology, memory_bytes: int | None, straight: bool,
    max_stages: int | None,
) -> Plan:
    """:func:`plan_pipeline` under PipeDream's terms, over its states, shown as layer ranges."""
    if memory_bytes is not None:
        raise PlanError(
            f"memory_bytes={memory_bytes}: the pipedream cost model reproduces PipeDream's "
            "optimizer without a memory limit; drop --memory or use --cost-model dreampipe"
        )
    states = pipedream_states(graph)
    prof = states.costs
    opts = Options(None, straight, False, _check_slots(max_stages, prof.n),
                   max_stages is not None, CostModel.PIPEDREAM)
    best = best_plan(prof, [topology], opts)
    if best is None:
        raise PlanError(
            f"no plan uses exactly {topology.num_workers} workers on PipeDream's {prof.n} "
            f"states with straight={straight}, max_stages={max_stages}; allow replication, "
            "raise max_stages or use --cost-model dreampipe"
        )
    value, flat = best
    spans, first = [], 0
    for s, f in enumerate(flat):
        last = len(graph.layers) - 1 if s == len(flat) - 1 else states.last_layer[f.last]
        spans.append((first, last))
        first = last + 1
    replicas = [f.replicas for f in flat]
    firsts = [0, *itertools.accumulate(replicas)]
    counts = in_flight_counts(replicas)
    memories = RangeCosts.of(graph).memories(spans, counts)
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

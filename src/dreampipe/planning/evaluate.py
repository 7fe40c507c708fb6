"""The cost of a plan given by hand, and the baselines every plan is compared with.

:func:`evaluate_plan` prices a partition (layers, replicas, optionally workers,
recomputation and tensor splits per stage) with
:func:`~dreampipe.planning.pricing.price_stages`, the terms the planner's
searches use, so a plan's own stages evaluate to its time. :func:`baselines`
gives data parallelism, the best straight pipeline and GPipe under the same
cost model.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from dreampipe.errors import PlanError
from dreampipe.planning.config_string import config_string
from dreampipe.planning.costs import CostModel, RangeCosts, gpipe_time
from dreampipe.planning.dp import Options, best_plan
from dreampipe.planning.memory_terms import STATELESS, OptimizerTerms
from dreampipe.planning.operator_search import Link
from dreampipe.planning.pipedream_costs import (
    pipedream_dp_time,
    pipedream_stage_time,
    pipedream_transfer_time,
)
from dreampipe.planning.plan import Plan, Stage
from dreampipe.planning.pricing import price_stages, slowest
from dreampipe.planning.search import cost_models, fastest, search_for
from dreampipe.planning.split_ranges import StageSplit, fits_servers, split_costs, split_options
from dreampipe.planning.splits import Split
from dreampipe.planning.sync import DEFAULT_SYNC, Sync
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph

__all__ = ["baselines", "evaluate_plan"]


def baselines(
    prof: RangeCosts, topology: Topology, memory: int | None, sync: Sync,
    model: CostModel = CostModel.DREAMPIPE,
) -> dict[str, float]:
    """Data parallelism, the best straight pipeline and GPipe on it, same cost model."""
    out: dict[str, float] = {}
    if model is CostModel.PIPEDREAM:
        levels = [(lv.count, lv.bandwidth) for lv in topology.levels]
        out["dp"] = pipedream_dp_time(float(prof.compute_s[0, -1]), float(prof.weights[0, -1]),
                                      levels)
        found = best_plan(prof, [topology], Options(None, True, True, 1, False, model))
        if found is not None:
            out["straight"] = found[0]
            out["gpipe"] = gpipe_time(found[0], len(found[1]))
        return out
    if memory is None or prof.memory(0, prof.n - 1, 1) <= memory:
        everyone = [range(topology.num_workers)]
        out["dp"] = slowest(price_stages(prof, topology, [(0, prof.n - 1)], everyone, sync))
    opts = Options(memory, True, True, 1, False, model, sync)
    straight = fastest(search_for(prof, topology), topology, cost_models(topology, True), opts)
    if straight is not None:
        out["straight"] = slowest(straight)
        out["gpipe"] = gpipe_time(out["straight"], len(straight))
    return out


def evaluate_plan(
    graph: LayerGraph, topology: Topology, bounds: Sequence[int], replicas: Sequence[int],
    cost_model: CostModel = CostModel.DREAMPIPE, *,
    workers: Sequence[Sequence[int]] | None = None, sync: Sync = DEFAULT_SYNC,
    memory_bytes: int | None = None, recompute: Sequence[bool] = (),
    tensor_parallel: Sequence[int] = (), splits: Sequence[Sequence[Split]] = (),
    optimizer: OptimizerTerms = STATELESS,
) -> Plan:
    """Cost a GIVEN partition: stage s is ``bounds[s]..bounds[s+1]-1`` on ``replicas[s]`` ranks.

    ``workers[s]`` places stage s on the topology (default: ranks laid in
    order, stage by stage); each all-reduce and cut is priced on the links
    its workers use, with the planner's own terms, so a plan's stages and
    workers evaluate to the plan's time; ``memory_bytes`` picks the stages'
    minibatches in flight as the planner does (:func:`price_stages`); ``recompute[s]``
    makes stage s recompute its activations (empty: none); ``tensor_parallel[s] = t > 1``
    runs each replica of stage s split over ``t`` workers of one server, as the fastest
    split of that width (:func:`~dreampipe.planning.split_ranges.split_options`), or
    as ``splits[s]`` says of each of its layers (a plan's ``Stage.splits``);
    ``workers[s]`` then lists each replica's first worker (empty: no split).
    Under ``CostModel.PIPEDREAM`` each stage costs PipeDream's additive term,
    ``Input`` layers zeroed, and a cut ``2a/(B r)`` on the stage after it. Every stage
    holds, beside its weights, what ``optimizer`` holds.
    """
    prof = RangeCosts.of(graph, optimizer)
    n = prof.n
    if len(bounds) > n:
        raise PlanError(f"{len(bounds)} stages forced on {n} layers; a stage needs a layer")
    edges = [*bounds, n]
    if not bounds or bounds[0] != 0 or any(b >= e for b, e in itertools.pairwise(edges)):
        raise PlanError(
            f"bounds {list(bounds)} must start at 0 and increase strictly below {n} layers"
        )
    if len(replicas) != len(bounds) or any(r < 1 for r in replicas):
        raise PlanError(
            f"replicas {list(replicas)}: need one count >= 1 per stage of bounds {list(bounds)}"
        )
    widths = list(tensor_parallel) or [1] * len(replicas)
    if len(widths) != len(replicas) or any(t < 1 for t in widths):
        raise PlanError(f"tensor_parallel {list(widths)}: need one width >= 1 per stage of "
                        f"bounds {list(bounds)}")
    sizes = [r * t for r, t in zip(replicas, widths, strict=True)]
    if sum(sizes) > topology.num_workers:
        raise PlanError(
            f"config {config_string(replicas, widths)} needs {sum(sizes)} workers but the "
            f"topology has {topology.num_workers}; use a larger topology or fewer replicas"
        )
    firsts = [sum(sizes[:s]) for s in range(len(sizes) + 1)]
    placed: list[Sequence[int]] = [range(firsts[s], firsts[s + 1]) for s in range(len(sizes))]
    if workers is not None:
        placed = [[w + k for w in ws for k in range(t)]
                  for ws, t in zip(workers, widths, strict=True)]
        flat = [w for ws in placed for w in ws]
        if ([len(w) for w in workers] != list(replicas) or len(set(flat)) != len(flat)
                or not all(0 <= w < topology.num_workers for w in flat)):
            raise PlanError(
                f"workers {[list(w) for w in workers]}: need {list(replicas)} distinct "
                f"workers per stage, each in 0..{topology.num_workers - 1}"
            )
    if recompute and len(recompute) != len(replicas):
        raise PlanError(f"recompute {list(recompute)}: need one flag per stage of bounds "
                        f"{list(bounds)}")
    spans = [(edges[s], edges[s + 1] - 1) for s in range(len(replicas))]
    if splits and len(splits) != len(replicas):
        raise PlanError(f"splits: need one entry per stage of bounds {list(bounds)} (empty "
                        "for an unsplit stage)")
    how = _stage_splits(graph, topology, widths, placed, optimizer)
    if splits:
        how = [_given(graph, topology, x, spans[s], split, optimizer)
               if x is not None and split else x
               for s, (x, split) in enumerate(zip(how, splits, strict=True))]
    stages = price_stages(prof, topology, spans, placed, sync, memory_bytes, recompute, how)
    time = slowest(stages)
    if cost_model is CostModel.PIPEDREAM:
        time = _pipedream_time(graph, topology, stages)
    return Plan(
        stages=stages, num_layers=n, batch_size=graph.batch_size, model=graph.model,
        topology=topology.describe(), time_per_minibatch_s=time,
        baselines_s=baselines(prof, topology, None, sync),
        layer_names=tuple(x.name for x in graph.layers),
    )


def _stage_splits(graph: LayerGraph, topology: Topology, widths: Sequence[int],
                  placed: Sequence[Sequence[int]], optimizer: OptimizerTerms
                  ) -> list[StageSplit | None]:
    """The fastest split of each stage's width (None: unsplit), checked to sit in servers."""
    options = {x.t: x for x in reversed(split_options(graph, topology,
                                                      [t for t in widths if t > 1],
                                                      optimizer))}
    out: list[StageSplit | None] = []
    for t, workers in zip(widths, placed, strict=True):
        if t == 1:
            out.append(None)
            continue
        runs = sorted(workers)
        ok = all(runs[k:k + t] == list(range(runs[k], runs[k] + t))
                 and fits_servers(runs[k], runs[k] + t, t, topology)
                 for k in range(0, len(runs), t))
        if t not in options or not ok:
            raise PlanError(
                f"a stage split over {t} workers on workers {runs}: a split needs a chain of "
                f"layers and each replica on {t} consecutive workers of one server of "
                f"{topology.levels[0].count}; pick t in 2, 4... up to a server's workers")
        out.append(options[t])
    return out


def _given(graph: LayerGraph, topology: Topology, split: StageSplit, span: tuple[int, int],
           layers: Sequence[Split], optimizer: OptimizerTerms) -> StageSplit:
    """``split``'s width with ``layers`` as the splits of the stage's layers ``span``."""
    first, last = span
    if len(layers) != last - first + 1:
        raise PlanError(f"splits {[x.value for x in layers]} for layers {first}..{last}: need "
                        "one per layer")
    chosen = (*split.splits[:first], *layers, *split.splits[last + 1:])
    inner = topology.levels[0]
    costs = split_costs(graph, split.t, Link(inner.bandwidth, inner.latency), chosen,
                        optimizer=optimizer)
    return StageSplit(split.t, chosen, costs)


def _pipedream_time(graph: LayerGraph, topology: Topology, stages: Sequence[Stage]) -> float:
    """PipeDream's time of given stages: ``(compute + 4(r-1)/r|w|/B)/r``, cuts ``2a/(B r)``."""
    layers = graph.layers
    worst = 0.0
    for s, st in enumerate(stages):
        span = range(st.first, st.last + 1)
        compute = sum(layers[i].compute_ms / 1e3 for i in span
                      if not layers[i].description.startswith("Input"))
        weights = float(sum(layers[i].parameter_bytes for i in span))
        bw = topology.bandwidth_between(min(st.placement), max(st.placement))
        worst = max(worst, float(pipedream_stage_time(compute, weights, st.replicas, bw)))
        if s > 0:
            link = topology.bandwidth_between(min(stages[s - 1].placement), max(st.placement))
            cut = graph.cut_activation_bytes(st.first)
            worst = max(worst, float(pipedream_transfer_time(cut, st.replicas, link)))
    return worst

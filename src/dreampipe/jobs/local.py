"""A job's plan and predicted throughput on the workers at hand.

``dreampipe train``, ``demo`` and ``bench`` all do the same three things
before they run anything: profile the model on this machine (one thread, as
each worker runs), plan it for the workers they have (or cost a partition
the user forced), and ask the simulator what throughput that plan should
reach on this machine (:mod:`dreampipe.jobs.machine`), so the run can print
predicted beside measured.
"""

from __future__ import annotations

import logging

from dreampipe.errors import ConfigError
from dreampipe.jobs.machine import local_costs, local_topology
from dreampipe.models.spec import ModelSpec
from dreampipe.planning.plan import Plan, parse_stage_bounds, stages_from_config
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runtime.launch import pinned_threads
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.units import UnitLayout

__all__ = ["choose_plan", "forced_partition", "predict_samples_per_s", "profile_as_worker"]

log = logging.getLogger(__name__)


def profile_as_worker(spec: ModelSpec, batch_size: int, *, repeats: int = 5) -> LayerGraph:
    """Profile ``spec`` at ``batch_size`` on one thread, as each worker runs."""
    from dreampipe.profiling.profiler import profile_spec

    with pinned_threads(1):
        return profile_spec(spec, batch_size=batch_size, repeats=repeats)


def forced_partition(
    num_layers: int, workers: int, config: str | None, stages: str | None
) -> tuple[list[int], list[int]] | None:
    """``(bounds, replicas)`` forced by ``config``/``stages``, or None to plan.

    ``config`` (``"2-1"``) and ``stages`` (``"0,4"``) give one replica count
    and one first layer per stage; ``stages`` alone means one worker per
    stage, ``config`` alone a single stage.
    """
    if config is None and stages is None:
        return None
    bounds = parse_stage_bounds(stages, num_layers) if stages is not None else [0]
    replicas = stages_from_config(config, len(bounds)) if config else [1] * len(bounds)
    if len(replicas) != len(bounds):
        raise ConfigError(
            f"config={config!r} has {len(replicas)} stages but stages="
            f"{stages or '0'!r} starts {len(bounds)}; give one first layer per stage",
            "config", "stages",
        )
    if sum(replicas) != workers:
        raise ConfigError(
            f"config={config or 'straight'!r} needs {sum(replicas)} workers, not {workers}; "
            f"use workers={sum(replicas)}", "config", "workers",
        )
    return bounds, replicas


def choose_plan(
    graph: LayerGraph,
    workers: int,
    *,
    config: str | None = None,
    stages: str | None = None,
    allow_fewer_workers: bool = True,
) -> Plan:
    """The planner's best plan for ``workers`` local workers, or the forced partition costed."""
    from dreampipe.planning import planner

    topology = local_topology(workers)
    forced = forced_partition(len(graph.layers), workers, config, stages)
    if forced is None:
        return planner.plan_pipeline(graph, topology, allow_fewer_workers=allow_fewer_workers)
    return planner.evaluate_plan(graph, topology, *forced)


def predict_samples_per_s(
    graph: LayerGraph,
    plan: Plan,
    kind: ScheduleKind,
    *,
    minibatch_size: int,
    microbatches: int,
    steps: int,
) -> float:
    """Samples/s the simulator predicts for ``steps`` updates of ``plan`` under ``kind``.

    ``graph`` must be profiled at the layout's unit size, so each scheduled
    unit costs what the profile measured.
    """
    from dreampipe.simulation.simulator import simulate_schedule

    layout = UnitLayout(kind=kind, minibatch_size=minibatch_size, microbatches=microbatches,
                        workers=plan.workers_used)
    schedule = layout.build([st.replicas for st in plan.stages], steps)
    fraction = layout.unit_size / graph.batch_size if graph.batch_size else 1.0
    result = simulate_schedule(schedule, local_costs(graph, plan, fraction))
    events = result.events
    span = max(e.end_s for e in events) - min(e.start_s for e in events) if events else 0.0
    if span <= 0:
        return 0.0
    return steps * minibatch_size / span

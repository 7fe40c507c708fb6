"""A job's plan and predicted throughput on the workers at hand.

``dreampipe train``, ``demo`` and ``bench`` all do the same three things
before they run anything: profile the model on this machine (one thread, as
each worker runs), plan it for the workers they have (or cost a partition
the user forced), and ask the simulator what throughput that plan should
reach on this machine (:mod:`dreampipe.machine.calibration`), so the run can print
predicted beside measured.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dreampipe.errors import ConfigError, ProfileError
from dreampipe.machine.calibration import (
    LocalCalibration,
    local_costs,
    local_topology,
    measured_machine,
)
from dreampipe.machine.measure import local_machine
from dreampipe.models.spec import ModelSpec
from dreampipe.planning.config_string import parse_stage_bounds, stages_from_config
from dreampipe.planning.plan import Plan
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import format_bytes
from dreampipe.runtime.processes import pinned_threads
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.units import UnitLayout
from dreampipe.simulation.action_costs import costs_from_profile
from dreampipe.simulation.choose import ScheduleChoice, Semantics, choose_schedule
from dreampipe.simulation.plan_choice import choose_plan_and_schedule

__all__ = ["choose_auto", "choose_plan", "forced_partition", "predict_interleaved",
           "predict_samples_per_s", "profile_as_worker", "saved_profile"]

log = logging.getLogger(__name__)

#: The most partitions ``choose_plan`` prices to place the cuts of a forced config.
_MAX_CUT_CHOICES = 20_000


def profile_as_worker(
    spec: ModelSpec, batch_size: int, *, repeats: int = 5, min_time_s: float = 0.0,
    twins: int = 0, crowd: int = 0, ref: str = "",
    model_kwargs: Sequence[tuple[str, Any]] = (),
) -> LayerGraph:
    """Profile ``spec`` at ``batch_size`` on one thread, as each worker runs, with the
    runtime's overhead over the layers (:mod:`~dreampipe.machine.overhead`).

    With ``twins`` > 0 the profile is taken beside that many busy processes
    training the same model (``ref`` and ``model_kwargs`` name it for them),
    as local workers compute side by side in a run, and ``crowd`` more
    measure how the cores are shared (:func:`dreampipe.machine.corun.profile_beside`).
    """
    if twins > 0 or crowd > 0:
        from dreampipe.machine.corun import profile_beside

        return profile_beside(ref, batch_size, twins, crowd=crowd, model_kwargs=model_kwargs,
                              repeats=repeats, min_time_s=min_time_s)
    from dreampipe.machine.overhead import with_runtime_overhead
    from dreampipe.profiling.profiler import profile_spec

    with pinned_threads(1):
        graph = profile_spec(spec, batch_size=batch_size, repeats=repeats, min_time_s=min_time_s)
        return with_runtime_overhead(graph, spec)


def saved_profile(path: str | Path, spec: ModelSpec, unit_size: int, *, ref: str = "",
                  model_kwargs: Sequence[tuple[str, Any]] = ()) -> LayerGraph:
    """The layer profile in ``path`` (``dreampipe profile -o``), checked to be ``spec``'s as
    one worker runs it: its layers and their weights, one thread, batch ``unit_size``.

    A job given one plans and predicts with it instead of profiling first. The
    runtime's overhead over the layers is measured now if the profile lacks it
    (:mod:`~dreampipe.machine.overhead`). Model arguments that change no weight
    (an image size, a sequence length) are checked only where the profile
    recorded them (``meta["model_kwargs"]``, as ``dreampipe profile`` does).
    """
    from dreampipe.machine.overhead import with_runtime_overhead
    from dreampipe.profiling.load import load_graph
    from dreampipe.profiling.profiler import new_parameter_bytes

    args = "".join(f" --model-arg {k}={v}" for k, v in model_kwargs)
    fix = (f"profile it as a worker runs it: OMP_NUM_THREADS=1 dreampipe profile "
           f"{ref or spec.name}{args} --batch-size {unit_size} -o {path}")
    graph = load_graph(path)
    where = f"profile {str(path)!r}"
    if graph.batch_size != unit_size:
        measured = (f"is of {graph.batch_size} samples" if graph.batch_size else
                    "does not say its batch size (a PipeDream graph.txt never does)")
        raise ProfileError(f"{where} {measured}, and each unit this run computes is "
                           f"{unit_size}; {fix}")
    names = [layer.name for layer in graph.layers]
    if names != spec.layer_names or (graph.model and graph.model != spec.name):
        raise ProfileError(
            f"{where} is of {graph.model or 'a model'} with {len(names)} layers "
            f"({_some(names)}), not {spec.name} with {spec.num_layers} "
            f"({_some(spec.layer_names)}); {fix}")
    recorded = graph.meta.get("model_kwargs")
    if recorded is not None and dict(recorded) != dict(model_kwargs):
        raise ProfileError(f"{where} is of {spec.name} sized {dict(recorded)}, and this run "
                           f"sizes it {dict(model_kwargs)}; {fix}")
    counted: set[int] = set()
    for layer, module in zip(graph.layers, spec.build(), strict=True):
        size = new_parameter_bytes(module.parameters(), counted)  # as the profiler counts
        if size != layer.parameter_bytes:
            raise ProfileError(
                f"{where}: layer {layer.name} holds {format_bytes(layer.parameter_bytes)} of "
                f"weights there and {format_bytes(size)} in {spec.name} here, so it was "
                f"profiled at another size; {fix}")
    threads = graph.meta.get("threads", 1)
    if graph.meta.get("device", "cpu") == "cpu" and threads != 1:
        raise ProfileError(f"{where} was taken on {threads} threads, and a local worker "
                           f"computes on one; {fix}")
    if "runtime_forward" in graph.meta:
        return graph
    with pinned_threads(1):
        return with_runtime_overhead(graph, spec)


def _some(names: Sequence[str]) -> str:
    """The first three ``names``, and ``..`` if there are more."""
    return ", ".join(names[:3]) + (", .." if len(names) > 3 else "")


def forced_partition(
    num_layers: int, workers: int, config: str | None, stages: str | None
) -> tuple[list[int] | None, list[int]] | None:
    """``(bounds, replicas)`` forced by ``config``/``stages``, or None to plan.

    ``config`` (``"2-1"``) and ``stages`` (``"0,4"``) give one replica count
    and one first layer per stage; ``stages`` alone means one worker per
    stage. ``config`` alone leaves the cuts to :func:`choose_plan` (bounds
    None), except for one stage, which starts at layer 0; ``"straight"``
    alone is one stage per worker.
    """
    if config is None and stages is None:
        return None
    if stages is None:
        assert config is not None
        replicas = stages_from_config(config, workers)
        if len(replicas) > num_layers:
            raise ConfigError(
                f"config={config!r} has {len(replicas)} stages but the model has "
                f"{num_layers} layers; use at most {num_layers} stages", "config",
            )
        bounds = None if len(replicas) > 1 else [0]
    else:
        bounds = parse_stage_bounds(stages, num_layers)
        replicas = stages_from_config(config, len(bounds)) if config else [1] * len(bounds)
        if len(replicas) != len(bounds):
            raise ConfigError(
                f"config={config!r} has {len(replicas)} stages but stages={stages!r} starts "
                f"{len(bounds)}; give one first layer per stage", "config", "stages",
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
    nodes: int = 1,
    memory_bytes: int | None = None,
    machine: LocalCalibration | None = None,
    max_stages: int | None = None,
) -> Plan:
    """The planner's best plan for ``workers`` local workers (of at most ``max_stages``
    stages), or the forced partition costed.

    A ``config`` without ``stages`` gets the cuts the planner prices fastest
    for those replica counts. ``nodes`` > 1 (a torchrun job over several
    nodes) plans on two levels, the nodes as servers (:func:`local_topology`).
    ``memory_bytes`` limits the planner's own choice (a forced partition is
    the caller's to check). ``machine`` is the calibration to plan with
    (default: this machine's, :func:`~dreampipe.machine.measure.local_machine`).
    """
    from dreampipe.planning import planner
    from dreampipe.planning.options import PlanOptions

    here = local_machine(workers) if machine is None else machine
    topology = local_topology(workers, measured_machine(graph, here), nodes=nodes)
    forced = forced_partition(len(graph.layers), workers, config, stages)
    if forced is None:
        return planner.plan_pipeline(graph, topology, PlanOptions(
            allow_fewer_workers=allow_fewer_workers, memory_bytes=memory_bytes,
            max_stages=max_stages, recompute=memory_bytes is not None))
    bounds, replicas = forced
    if bounds is not None:
        return planner.evaluate_plan(graph, topology, bounds, replicas)
    return _best_cuts(graph, topology, replicas)


def choose_auto(
    graph: LayerGraph,
    workers: int,
    semantics: Semantics,
    given: Plan | None,
    *,
    nodes: int = 1,
    memory_bytes: int | None = None,
    machine: LocalCalibration | None = None,
    microbatches: int | None = None,
    allow_fewer_workers: bool = True,
) -> tuple[Plan, ScheduleChoice, list[str]]:
    """``schedule="auto"`` on ``workers`` local workers: the fastest schedule of
    ``semantics`` on ``given`` that fits ``memory_bytes``, or, when the planner chooses
    (``given`` None), the fastest pair over its plans of each number of stages
    (:mod:`dreampipe.simulation.plan_choice`); with the lines that say why, for the user."""
    here = local_machine(workers) if machine is None else machine
    topology = local_topology(workers, measured_machine(graph, here), nodes=nodes)
    lines = []
    if given is None:
        picked = choose_plan_and_schedule(
            graph, topology, semantics,
            lambda k: choose_plan(graph, workers, allow_fewer_workers=allow_fewer_workers,
                                  nodes=nodes, memory_bytes=memory_bytes, machine=here,
                                  max_stages=k),
            min(workers, len(graph.layers)), memory_bytes=memory_bytes,
            microbatches=microbatches)
        lines += [f"plan auto ({semantics.value}): the planner's plan of each number of "
                  "stages, each with its fastest schedule:", *(f"  {x}" for x in picked.lines)]
        plan, choice = picked.plan, picked.schedule
    else:
        plan, choice = given, choose_schedule(graph, given, topology, semantics, memory_bytes,
                                              microbatches)
    lines += [f"schedule auto ({semantics.value}): {choice.kind.value}, the fastest that "
              f"fits, with {choice.microbatches} microbatches per minibatch:",
              *(f"  {x}" for x in choice.reasons())]
    return plan, choice, lines


def _best_cuts(graph: LayerGraph, topology: Topology, replicas: list[int]) -> Plan:
    """The fastest partition into ``len(replicas)`` stages with these replica counts."""
    from dreampipe.planning import planner

    n, k = len(graph.layers), len(replicas)
    if math.comb(n - 1, k - 1) > _MAX_CUT_CHOICES:
        raise ConfigError(
            f"config={'-'.join(map(str, replicas))!r} on {n} layers leaves "
            f"{math.comb(n - 1, k - 1)} ways to cut; give the first layer of each stage "
            "with stages (e.g. 0,4)", "stages",
        )
    plans = (planner.evaluate_plan(graph, topology, [0, *cuts], replicas)
             for cuts in itertools.combinations(range(1, n), k - 1))
    best = min(plans, key=lambda plan: plan.time_per_minibatch_s)
    log.info("config %s: the fastest cuts start stages at %s", best.config,
             [st.first for st in best.stages])
    return best


def predict_samples_per_s(
    graph: LayerGraph,
    plan: Plan,
    kind: ScheduleKind,
    *,
    minibatch_size: int,
    microbatches: int,
    steps: int,
    nodes: int = 1,
    machine: LocalCalibration | None = None,
) -> float:
    """Samples/s the simulator predicts for ``steps`` updates of ``plan`` under ``kind``.

    A ``graph`` profiled at the layout's unit size gives each scheduled unit
    what the profile measured; one at another batch is scaled to it in
    proportion, a rough guess (``train`` refuses such a profile); ``nodes``
    and ``machine`` as for :func:`choose_plan`.
    """
    from dreampipe.simulation.simulator import simulate_schedule

    layout = UnitLayout(kind=kind, minibatch_size=minibatch_size, microbatches=microbatches,
                        workers=plan.workers_used)
    schedule = layout.build([st.replicas for st in plan.stages], steps, plan.in_flight)
    fraction = layout.unit_size / graph.batch_size if graph.batch_size else 1.0
    here = local_machine(plan.workers_used) if machine is None else machine
    result = simulate_schedule(schedule, local_costs(graph, plan, fraction,
                                                     measured_machine(graph, here), nodes=nodes))
    events = result.events
    span = max(e.end_s for e in events) - min(e.start_s for e in events) if events else 0.0
    if span <= 0:
        return 0.0
    return steps * minibatch_size / span


def predict_interleaved(graph: LayerGraph, plan: Plan, layout: UnitLayout, steps: int,
                        topology: Topology) -> float:
    """Samples/s the simulator predicts for ``steps`` updates of the interleaved ``plan``
    (its ``virtual_stages`` to a worker)."""
    from dreampipe.simulation.simulator import simulate_schedule

    schedule = layout.build([1] * plan.num_stages, steps, virtual_stages=plan.virtual_stages)
    fraction = layout.unit_size / graph.batch_size if graph.batch_size else 1.0
    result = simulate_schedule(schedule, costs_from_profile(graph, plan, topology, fraction))
    return result.throughput_minibatches_per_s * (graph.batch_size or layout.unit_size)

"""``dreampipe train --schedule auto``: the schedule (and, when the planner chooses, the
plan) the simulator finds fastest, with a line per candidate for the user."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dreampipe.machine.calibration import LocalCalibration, local_topology, measured_machine
from dreampipe.machine.local_plan import choose_plan
from dreampipe.planning.plan import Plan
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.units import UnitLayout
from dreampipe.simulation.choose import Semantics, choose_schedule
from dreampipe.simulation.costs import costs_from_profile
from dreampipe.simulation.plan_choice import choose_plan_and_schedule
from dreampipe.simulation.simulator import simulate_schedule

__all__ = ["Auto", "choose_for_train", "predict_interleaved"]


@dataclass(frozen=True)
class Auto:
    """What ``--schedule auto`` chooses with: the semantics, ``--memory`` per worker and
    ``--microbatches``."""

    semantics: Semantics
    memory_bytes: int | None
    microbatches: int


def choose_for_train(graph: LayerGraph, plan: Plan, auto: Auto, workers: int,
                     machine: LocalCalibration, nodes: int, talk: Callable[[str], None], *,
                     free: bool, fewer: bool) -> tuple[Plan, tuple[ScheduleKind, int]]:
    """The fastest schedule of ``auto.semantics`` that fits ``--memory``, by the simulator,
    with a line per candidate saying why. When the planner chooses the plan too
    (``free``), its plan of each number of stages is tried, and the fastest pair kept
    (:mod:`dreampipe.simulation.plan_choice`)."""
    topology = local_topology(workers, measured_machine(graph, machine), nodes=nodes)
    if free:
        picked = choose_plan_and_schedule(
            graph, topology, auto.semantics,
            lambda k: choose_plan(graph, workers, allow_fewer_workers=fewer, nodes=nodes,
                                  memory_bytes=auto.memory_bytes, machine=machine,
                                  max_stages=k),
            min(workers, len(graph.layers)), memory_bytes=auto.memory_bytes,
            microbatches=auto.microbatches)
        talk(f"plan auto ({auto.semantics.value}): the planner's plan of each number of "
             "stages, each with its fastest schedule:")
        for line in picked.lines:
            talk(f"  {line}")
        plan, choice = picked.plan, picked.schedule
    else:
        choice = choose_schedule(graph, plan, topology, auto.semantics, auto.memory_bytes,
                                 auto.microbatches)
    talk(f"schedule auto ({auto.semantics.value}): {choice.kind.value}, the fastest that "
         f"fits, with {choice.microbatches} microbatches per minibatch:")
    for line in choice.reasons():
        talk(f"  {line}")
    return plan, (choice.kind, choice.microbatches)


def predict_interleaved(graph: LayerGraph, plan: Plan, layout: UnitLayout, v: int, steps: int,
                        topology: Topology) -> float:
    """Samples/s the simulator predicts for ``steps`` updates of the interleaved ``plan``."""
    schedule = layout.build([1] * plan.num_stages, steps, virtual_stages=v)
    fraction = layout.unit_size / graph.batch_size if graph.batch_size else 1.0
    result = simulate_schedule(schedule, costs_from_profile(graph, plan, topology, fraction,
                                                            virtual_stages=v))
    return result.throughput_minibatches_per_s * (graph.batch_size or layout.unit_size)

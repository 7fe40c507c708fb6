"""What a run's plan should reach on this machine: samples/s, by the simulator.

The run's schedule is built as the runtime will run it and simulated with
this machine's costs (:func:`~dreampipe.machine.calibration.local_costs`:
the profile's layer times plus what the runtime pays around them), so a run
can print the prediction beside what it measures. An interleaved plan is
priced on the profile alone (docs/design.md §9.1).
"""

from __future__ import annotations

import dataclasses

from dreampipe.machine.calibration import (
    LocalCalibration,
    local_costs,
    measured_machine,
    measured_topology,
)
from dreampipe.planning.plan import Plan
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runtime.staleness import stage_delays
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout
from dreampipe.simulation.action_costs import costs_from_profile
from dreampipe.simulation.simulator import simulate_schedule
from dreampipe.simulation.zero_costs import with_zero

__all__ = ["predict_samples_per_s"]


def predict_samples_per_s(graph: LayerGraph, plan: Plan, layout: MicrobatchLayout, steps: int,
                          machine: LocalCalibration, *, nodes: int = 1, zero: int = 0,
                          steps_agree: bool = False, clips: bool = False,
                          step_factor: float = 1.0, prediction_factor: float = 0.0,
                          vertical_sync: bool = False) -> float:
    """Samples/s the simulator predicts for ``steps`` updates of ``plan`` run as ``layout``
    says on ``machine``'s workers (``nodes`` > 1: a torchrun job over several nodes), its
    replicated stages sharded at the run's ZeRO level ``zero`` or their own
    (:mod:`~dreampipe.simulation.zero_costs`); ``steps_agree``: the ranks agree before every
    update (:attr:`~dreampipe.runtime.runner_options.RunnerOptions.steps_agree`);
    ``step_factor``: the run's optimizer's step in plain SGD steps
    (:func:`~dreampipe.machine.step_time.step_factor`), whose traffic prices ``step_s``
    (:func:`~dreampipe.machine.calibration.local_costs`); ``clips``: each update clips its
    gradients by their global norm, which reads every gradient twice and writes it once,
    one plain SGD step's traffic more; ``prediction_factor``: the work weight prediction adds
    to a delayed stage's update, in plain SGD steps of its weights
    (:func:`~dreampipe.machine.step_time.prediction_factor`; 0 where the run does not
    predict, :func:`~dreampipe.runtime.staleness.predicting` decides), booked on every
    stage whose delay (``vertical_sync``: the input stage's) is above 0.

    A ``graph`` profiled at the layout's microbatch gives each scheduled one
    what the profile measured; one at another batch is scaled to it in
    proportion, a rough guess (``train`` refuses such a profile).
    """
    v = plan.virtual_stages
    fraction = layout.microbatch_size / graph.batch_size if graph.batch_size else 1.0
    if v > 1:
        schedule = layout.build([1] * plan.num_stages, steps, virtual_stages=v,
                                steps_agree=steps_agree)
        topology = measured_topology(graph, plan.workers_used, machine, nodes=nodes)
        costs = costs_from_profile(graph, plan, topology, fraction)
        plain = costs.step_s
    else:
        levels = plan.zero_levels(zero)
        schedule = layout.build([st.replicas for st in plan.stages], steps, plan.in_flight,
                                zero=levels, steps_agree=steps_agree)
        local = local_costs(graph, plan, fraction, measured_machine(graph, machine), nodes=nodes)
        plain, costs = local.step_s, with_zero(local, schedule, levels)
    delays = stage_delays(schedule, vertical_sync) if prediction_factor else (0,) * plan.num_stages
    costs = dataclasses.replace(costs, steps_agree=steps_agree, step_s=tuple(
        (step_factor + (1.0 if clips else 0.0)) * s + (prediction_factor * p if d else 0.0)
        for s, p, d in zip(costs.step_s, plain, delays, strict=True)))
    makespan = simulate_schedule(schedule, costs, record_events=False).makespan_s
    samples = steps * layout.microbatches_per_update * layout.microbatch_size
    return samples / makespan if makespan > 0 else 0.0

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
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout
from dreampipe.simulation.action_costs import costs_from_profile
from dreampipe.simulation.simulator import simulate_schedule
from dreampipe.simulation.zero_costs import with_zero

__all__ = ["predict_samples_per_s"]


def predict_samples_per_s(graph: LayerGraph, plan: Plan, layout: MicrobatchLayout, steps: int,
                          machine: LocalCalibration, *, nodes: int = 1, zero: int = 0,
                          steps_agree: bool = False, clips: bool = False,
                          step_factor: float = 1.0) -> float:
    """Samples/s the simulator predicts for ``steps`` updates of ``plan`` run as ``layout``
    says on ``machine``'s workers (``nodes`` > 1: a torchrun job over several nodes), its
    replicated stages sharded at the run's ZeRO level ``zero`` or their own
    (:mod:`~dreampipe.simulation.zero_costs`); ``steps_agree``: the ranks agree before every
    update (:attr:`~dreampipe.runtime.runner_options.RunnerOptions.steps_agree`);
    ``step_factor``: the run's optimizer's step in plain SGD steps
    (:func:`~dreampipe.machine.step_time.step_factor`), whose traffic prices ``step_s``
    (:func:`~dreampipe.machine.calibration.local_costs`); ``clips``: each update clips its
    gradients by their global norm, which reads every gradient twice and writes it once,
    one plain SGD step's traffic more.

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
    else:
        levels = plan.zero_levels(zero)
        schedule = layout.build([st.replicas for st in plan.stages], steps, plan.in_flight,
                                zero=levels, steps_agree=steps_agree)
        costs = with_zero(local_costs(graph, plan, fraction, measured_machine(graph, machine),
                                      nodes=nodes), schedule, levels)
    costs = dataclasses.replace(costs, steps_agree=steps_agree, step_s=tuple(
        (step_factor + (1.0 if clips else 0.0)) * s for s in costs.step_s))
    makespan = simulate_schedule(schedule, costs, record_events=False).makespan_s
    samples = steps * layout.microbatches_per_update * layout.microbatch_size
    return samples / makespan if makespan > 0 else 0.0

"""One copy of a synchronous plan's pipeline, simulated from the plan's own stage terms.

The synchronous objective (:mod:`dreampipe.planning.sync_objective`) prices an update by
a closed form; under interleaving it charges every chunk as the largest, a bound that is
loose when the chunks holding the embedding and the head are heavier than the rest. This
module times the plan's schedule action by action instead: every copy of the pipeline
runs alike, so one copy of ``p`` ranks is simulated, each stage (chunk) taking its
``tau`` split into forward and backward (recomputation, tensor collectives and ZeRO-3's
gathers included), its cut blocking it as the send and receive of a flushed pipeline do,
and the update's largest tail (the all-reduce left after the last backward, ZeRO's work)
added at the end, as the objective adds it. This runs on any layout, interleaved copies
of split stages included, which the runtime's plan cannot express (docs/planner.md, "The
synchronous objective").
"""

from __future__ import annotations

from dreampipe.planning.sync_plan import SyncPlan, SyncStage
from dreampipe.planning.zero_terms import HALF_ALLREDUCE, SHARDED_LEVEL
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.simulation.action_costs import SimCosts
from dreampipe.simulation.simulator import simulate_schedule

__all__ = ["simulate_copy"]


def simulate_copy(plan: SyncPlan, updates: int = 1) -> float:
    """Seconds per update of one copy of ``plan``'s pipeline over ``updates`` updates
    (module doc)."""
    per_update = plan.microbatches
    schedule = build_schedule([1] * len(plan.stages), ScheduleKind(plan.schedule.value),
                              updates * per_update, per_update,
                              virtual_stages=plan.virtual_stages)
    forward = tuple(st.forward_s + _gather(st) + st.cut_s / 2 for st in plan.stages)
    backward = tuple(st.tau_s - st.forward_s - _gather(st) + st.cut_s / 2
                     for st in plan.stages)
    costs = SimCosts(forward_s=forward, backward_s=backward)
    took = simulate_schedule(schedule, costs, record_events=False).makespan_s / updates
    return took + max(st.tail_s for st in plan.stages)


def _gather(st: SyncStage) -> float:
    """What a stage's forward gathers at ZeRO-3 before it runs (its ``tau`` counts one
    gather for the forward and one for the backward, :mod:`~dreampipe.planning.zero_terms`)."""
    return st.allreduce_s * HALF_ALLREDUCE if st.option.zero >= SHARDED_LEVEL else 0.0

"""What ZeRO's levels cost in time: the simulator's per-action costs as a run pays them.

The rule (docs/design.md §5.6). At levels 1 and 2 a replicated stage's ``STEP`` ends with
an all-gather of the updated weights (``gather_s``). At level 2 or more it reduce-scatters each
microbatch's gradient as its backward makes it: half an all-reduce's bytes, starting
``allreduce_delay_s`` into the backward (its first bucket), and the backward waits for
the last one, so the action that completes the gradient (``B``, or ``W`` where the schedule
splits the backward) ends no earlier than the reduce-scatter; the round's ``ALLREDUCE``
then has nothing left to send. At level 3 per use (:func:`~dreampipe.scheduling.unshard.
pairs_per_use`) each forward and each backward also gathers the stage's weights, layer by
layer in its path (``gather_s`` each), and ``UNSHARD`` gathers nothing; per update the
``UNSHARD`` takes ``gather_s`` as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import Schedule
from dreampipe.scheduling.unshard import SHARDED_LEVEL, pairs_per_use
from dreampipe.simulation.action_costs import SimCosts

__all__ = ["with_zero"]


def with_zero(costs: SimCosts, schedule: Schedule, levels: Sequence[int]) -> SimCosts:
    """``costs`` as each stage's ZeRO ``levels`` change them (module docstring)."""
    if len(levels) != schedule.num_stages:
        raise ScheduleError(f"{len(levels)} ZeRO levels for {schedule.num_stages} stages; "
                            "give one a stage")
    fwd, bwd = list(costs.forward_s), list(costs.backward_s)
    wgrad, ar, gather = list(costs.weight_grad_s), list(costs.allreduce_s), list(costs.gather_s)
    split = schedule.kind.splits_backward
    step = list(costs.step_s)
    for s, level in enumerate(levels):
        if level < 1 or schedule.replicas[s] < 2:
            continue
        if level < SHARDED_LEVEL:
            step[s] += gather[s]
        if level < 2:
            continue
        scatter = costs.allreduce_s[s] / 2
        if split:  # W completes the gradient; its reduce-scatter starts with it
            tail = max(0.0, scatter - wgrad[s])
            wgrad[s] += tail
        else:
            tail = max(0.0, costs.allreduce_delay_s[s] + scatter - bwd[s])
        bwd[s] += tail
        ar[s] = 0.0
        if level >= SHARDED_LEVEL and pairs_per_use(schedule, s):
            fwd[s] += gather[s]
            bwd[s] += gather[s]
            gather[s] = 0.0
    return dataclasses.replace(costs, forward_s=tuple(fwd), backward_s=tuple(bwd),
                               weight_grad_s=tuple(wgrad), allreduce_s=tuple(ar),
                               gather_s=tuple(gather), step_s=tuple(step))

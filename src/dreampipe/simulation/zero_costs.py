"""What ZeRO's levels cost in time: the simulator's per-action costs as a run pays them.

Each stage's forward, backward, weight-gradient part, all-reduce, gather and step are
:func:`~dreampipe.planning.zero_terms.zero_times` of its costs (the rule: that module
and docs/design.md §5.6), a level-3 stage gathering per use where
:func:`~dreampipe.scheduling.unshard.pairs_per_use` holds and otherwise at its
``UNSHARD``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dreampipe.errors import ScheduleError
from dreampipe.planning.state_bytes import Training, profiled_param_bytes
from dreampipe.planning.zero_terms import zero_times
from dreampipe.profiling.graph import LayerGraph
from dreampipe.scheduling.actions import Schedule
from dreampipe.scheduling.unshard import SHARDED_LEVEL, pairs_per_use
from dreampipe.simulation.action_costs import SimCosts

__all__ = ["state_bytes", "with_zero"]


def with_zero(costs: SimCosts, schedule: Schedule, levels: Sequence[int]) -> SimCosts:
    """``costs`` as each stage's ZeRO ``levels`` change them (module docstring)."""
    if len(levels) != schedule.num_stages:
        raise ScheduleError(f"{len(levels)} ZeRO levels for {schedule.num_stages} stages; "
                            "give one a stage")
    fwd, bwd = list(costs.forward_s), list(costs.backward_s)
    wgrad, ar, gather = list(costs.weight_grad_s), list(costs.allreduce_s), list(costs.gather_s)
    step = list(costs.step_s)
    for s, level in enumerate(levels):
        per_use = level >= SHARDED_LEVEL and pairs_per_use(schedule, s)
        z = zero_times(level, schedule.replicas[s], forward=fwd[s], backward=bwd[s],
                       weight_grad=wgrad[s], allreduce=ar[s],
                       delay=costs.allreduce_delay_s[s], gather=gather[s],
                       splits_backward=schedule.kind.splits_backward, per_use=per_use)
        fwd[s], bwd[s], wgrad[s] = float(z.forward), float(z.backward), float(z.weight_grad)
        ar[s], gather[s], step[s] = float(z.allreduce), float(z.gather), step[s] + float(z.step)
    return dataclasses.replace(costs, forward_s=tuple(fwd), backward_s=tuple(bwd),
                               weight_grad_s=tuple(wgrad), allreduce_s=tuple(ar),
                               gather_s=tuple(gather), step_s=tuple(step))


def state_bytes(training: Training, weights: Sequence[float], levels: Sequence[int],
                replicas: Sequence[int], graph: LayerGraph | None) -> tuple[float, ...]:
    """Each stage's weights' state beyond the weight and gradient the simulator counts, as
    the planner prices it (:meth:`~dreampipe.planning.state_bytes.Training.state_per_byte`):
    the optimizer's, less the shards ZeRO keeps elsewhere (negative where only the
    gradients are sharded); level 3 as level 2, since the simulator frees the weights
    between uses itself."""
    profiled = profiled_param_bytes(graph) if graph is not None else 4
    return tuple(w * (training.state_per_byte(profiled, min(level, 2), r) - 2.0)
                 for w, level, r in zip(weights, levels, replicas, strict=True))

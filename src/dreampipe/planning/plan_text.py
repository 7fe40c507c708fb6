"""A plan as ``str(plan)`` prints it: its config, time and rate, then a line per stage.

The head says the config, the workers and, where the plan carries a time, the planner's
rate for the profiled batch; each stage's line its layers, replicas, split, schedule
ranks and, where the plan names them, the workers it lays the stage on (docs/design.md
§4.6).
"""

from __future__ import annotations

from typing import Protocol

from dreampipe.planning.placement import Placement
from dreampipe.planning.plan_stage import Stage

__all__ = ["plan_text"]


class Plan(Protocol):
    """What the text reads of a :class:`~dreampipe.planning.plan.Plan` (which prints itself
    with this module, so it is not imported here)."""

    @property
    def model(self) -> str: ...

    @property
    def virtual_stages(self) -> int: ...

    @property
    def placement(self) -> Placement: ...

    @property
    def time_per_minibatch_s(self) -> float: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def stages(self) -> tuple[Stage, ...]: ...

    @property
    def layer_names(self) -> tuple[str, ...]: ...

    @property
    def config(self) -> str: ...

    @property
    def workers_used(self) -> int: ...

    @property
    def throughput_minibatches_per_s(self) -> float: ...

    def stage_workers(self, s: int) -> tuple[int, ...]: ...


def plan_text(plan: Plan) -> str:
    """``plan`` in lines: the head, then one per stage."""
    head = f"plan {plan.config} for {plan.model or 'model'} on {plan.workers_used} workers"
    if plan.virtual_stages > 1:
        head += f", {plan.virtual_stages} stages per worker"
        head += " in a V" if plan.placement is Placement.V else ""
    if plan.time_per_minibatch_s > 0:  # a minibatch here is the profile's batch
        rate = plan.throughput_minibatches_per_s
        head += (
            f": {plan.time_per_minibatch_s * 1e3:.2f} ms per profiled batch of "
            f"{plan.batch_size} samples, {rate * plan.batch_size:.1f} samples/s"
            if plan.batch_size else
            f": {plan.time_per_minibatch_s * 1e3:.2f} ms per profiled batch, "
            f"{rate:.2f} batches/s"
        ) + " by the planner's objective"
    lines = [head]
    for s, st in enumerate(plan.stages):
        names = ""
        if plan.layer_names:
            names = f" ({plan.layer_names[st.first]} .. {plan.layer_names[st.last]})"
        split = ""
        if st.tensor_parallel > 1:
            split = (f" split over {st.tensor_parallel} workers "
                     f"({' '.join(x.value for x in st.splits)})")
        laid = f" on workers {list(plan.stage_workers(s))}" if st.workers else ""
        lines.append(f"  stage {s}: layers {st.first}..{st.last}{names} x{st.replicas}"
                     f"{split} ranks {list(st.ranks)}{laid}")
    return "\n".join(lines)

"""A plan chosen for its schedule: the planner's stage counts, each simulated.

The planner prices PipeDream's steady state, where the slowest stage sets
the pace and a deeper pipeline costs nothing more. A synchronous schedule
pays for depth: 1F1B-flush idles ``(p - 1)`` stage times per minibatch,
Zero Bubble a third of that, GPipe holds every microbatch. So the cut that
is fastest depends on the schedule: :func:`choose_plan_and_schedule` takes
the planner's plan for each cap on the number of stages (1 .. workers, the
distinct ones), simulates the schedules of the semantics on every one
(:func:`~dreampipe.simulation.choose.choose_schedule`), and keeps the
fastest pair that fits the memory::

    stages cap    plan        zb-h1      1f1b-flush   ...
    1             4           41.0/s     41.0/s
    2             2-2         55.3/s     49.7/s       <- kept
    4             straight    52.1/s     44.0/s
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dreampipe.errors import ConfigError, PlanError
from dreampipe.planning.plan import Plan
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.simulation.choose import ScheduleChoice, Semantics, choose_schedule

__all__ = ["PlanChoice", "choose_plan_and_schedule"]


@dataclass(frozen=True)
class PlanChoice:
    """The kept plan and its schedule, and one line per plan tried."""

    plan: Plan
    schedule: ScheduleChoice
    lines: tuple[str, ...]


def choose_plan_and_schedule(
    graph: LayerGraph, topology: Topology, semantics: Semantics,
    plan_for: Callable[[int], Plan], most_stages: int, *,
    memory_bytes: int | None = None, microbatches: int | None = None,
) -> PlanChoice:
    """The fastest (plan, schedule) of ``semantics``: ``plan_for(k)`` is the planner's plan
    of at most ``k`` stages, for ``k`` in ``1 .. most_stages`` (module doc)."""
    tried: dict[str, tuple[Plan, ScheduleChoice]] = {}
    lines: list[str] = []
    for k in range(1, most_stages + 1):
        try:
            plan = plan_for(k)
        except PlanError as exc:  # no plan of so few stages fits: more may
            lines.append(f"<= {k} stages: none fits ({exc})")
            continue
        if plan.config in tried:
            continue
        try:
            tried[plan.config] = (plan, choose_schedule(graph, plan, topology, semantics,
                                                        memory_bytes, microbatches))
        except ConfigError as exc:  # no schedule of these semantics fits its memory
            lines.append(f"{plan.config:<12} not kept: {exc}")
    if not tried:
        raise ConfigError(f"no plan of 1 to {most_stages} stages has a {semantics.value} "
                          "schedule that fits: " + "; ".join(lines), "memory_bytes")
    best = max(tried.values(), key=lambda pair: _rate(pair[1]))
    for config, (plan, choice) in tried.items():
        verdict = "kept: the fastest" if plan is best[0] else "slower"
        lines.append(f"{config:<12} {choice.kind.value:<11} {_rate(choice):10.3f} "
                     f"minibatches/s: {verdict}")
    return PlanChoice(best[0], best[1], tuple(lines))


def _rate(choice: ScheduleChoice) -> float:
    return next(c.minibatches_per_s for c in choice.candidates if c.kind is choice.kind)

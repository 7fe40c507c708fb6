"""The simulated check of a plan, as ``dreampipe plan`` reports it: one line, and a warning
when the simulator parts from the planner's prediction.

The planner prices a steady state term by term; the simulator runs the plan's schedule
action by action. Where they part by more than :data:`CHECK_TOLERANCE`, the simulated
figure is the one to trust, and the warning says which of the planner's terms is the
likely cause (docs/planner.md, "Where the planner and the simulator part").
"""

from __future__ import annotations

from dreampipe.planning.in_flight import in_flight_counts, short_of_rounds
from dreampipe.planning.plan import Plan
from dreampipe.simulation.simulator import SimResult

__all__ = ["CHECK_TOLERANCE", "check_ratio", "check_warning", "format_check"]

#: How far the simulated rate may be from the prediction before the check warns.
CHECK_TOLERANCE = 0.10


def check_ratio(result: Plan, sim: SimResult) -> float:
    """The simulated steady rate over the predicted one (0 when there is no prediction)."""
    predicted = result.throughput_minibatches_per_s
    return sim.steady_throughput_minibatches_per_s / predicted if predicted > 0 else 0.0


def format_check(result: Plan, sim: SimResult) -> str:
    """The check's line: the simulated rate, its window, its share of the prediction."""
    rate = sim.steady_throughput_minibatches_per_s
    window = (f"{sim.steady_microbatches} in the steady state" if sim.steady_microbatches
              else "too few for a steady state: start-up and drain included")
    return (
        f"simulated: {rate:.2f} minibatches/s over {sim.num_microbatches} minibatches ({window}; "
        f"{check_ratio(result, sim):.0%} of the prediction; {sim.bubble_fraction:.0%} of "
        "worker time idle)"
    )


def check_warning(result: Plan, sim: SimResult) -> str | None:
    """A warning when the check parts from the prediction by more than the tolerance,
    naming the likely cause; None when it agrees (or has no steady state to judge)."""
    ratio = check_ratio(result, sim)
    if not sim.steady_microbatches or abs(ratio - 1.0) <= CHECK_TOLERANCE:
        return None
    head = (f"warning: the simulator runs this plan at {ratio:.0%} of the planner's "
            "prediction; trust the simulated figure. ")
    if ratio < 1.0:
        replicas = [st.replicas for st in result.stages]
        widths = [st.tensor_parallel for st in result.stages]
        short = short_of_rounds(replicas, widths, [st.in_flight for st in result.stages])
        if short:
            wanted = in_flight_counts(replicas, 0, widths)
            held = [result.stages[s].in_flight for s in short]
            return head + (
                f"Stages {list(short)} hold {held} minibatches in flight, fewer than the "
                f"{[wanted[s] for s in short]} that keep the replicated stages' rounds "
                "whole (the memory limit leaves them short), so replicas wait for each "
                "other at each all-reduce, and the planner's steady state does not "
                "price that wait.")
        return head + ("The schedule waits where the planner's steady state does not "
                       "(replicas or stages waiting for each other).")
    return head + ("A cut is priced with both its directions, and all the pairs that cross "
                   "a level, on one link; the simulator runs them on each server's own "
                   "links, side by side.")

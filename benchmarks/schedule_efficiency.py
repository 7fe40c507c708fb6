"""How much of the planner's steady-state bound PipeDream's 1F1B-RR schedule reaches.

The planner prices a plan by its slowest stage: ``T = max_s (F_s + B_s) / m_s``
on ``m_s`` replicas. This benchmark builds toy pipelines where every stage
sits exactly at that bound (``F_s = m_s``, ``B_s = 2 m_s``, so ``T = 3``),
simulates the PipeDream schedule the runtime executes, and prints the
simulated steady-state rate over ``1 / T``:

- ``no comm``: free transfers and all-reduces;
- ``all-reduce = T``: replicated stages all-reduce for ``T`` per round;
- ``transfer = T``: each cut takes ``T`` to cross, in each direction.

Every row below 100% is a plan whose prediction the schedule cannot reach.

Then the minibatches in flight (:mod:`dreampipe.planning.in_flight`): random pipelines
of 2 to 5 stages of 1 to 6 replicas, balanced, each replicated stage all-reducing for
half, one or two times the most replicated stage's forward from 0.05 into its backward,
run with PipeDream's counts, the join buffer of 2, and each aligned to whole rounds (the
default: aligned, join 2); a pipeline reaches the bound when its simulated time per
minibatch is within 2% of the planner's ``max_s max(C_s, F_s + end_s) / r_s``. Last, the
lead two replicated stages need (docs/design.md §5.2): the fewest minibatches the first
holds over the second at which three balanced stages ``a``, ``b``, 1 reach the bound,
beside the lead the rule gives (in whole minibatches per replica of the first).
The simulation is deterministic, so one run is the figure; it takes about a minute.

    python benchmarks/schedule_efficiency.py [--write-docs]
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Sequence

import _docs

from dreampipe.errors import ScheduleError
from dreampipe.planning.in_flight import in_flight_counts, round_lead
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.simulation.simulator import SimCosts, simulate_schedule

__all__ = ["balanced_time", "efficiency", "main"]

CONFIGS = ((1, 1), (2, 2), (2, 1), (1, 2), (4, 3), (3, 4), (2, 2, 2), (1, 2, 1), (1, 4, 1),
           (2, 4, 3, 1))
_PERIOD = 3.0
#: (name, join, aligned) of the counts the random pipelines run with
_COUNTS = (("PipeDream's", 0, False), ("join 2", 2, False), ("PipeDream's, aligned", 0, True),
           ("join 2, aligned (default)", 2, True))
_PAIRS = ((1, 4), (2, 3), (3, 2), (2, 4), (4, 2), (3, 4), (4, 3), (2, 5), (3, 5), (4, 6),
          (6, 4), (3, 3), (4, 4))
_DELAY = 0.05


def efficiency(replicas: tuple[int, ...], *, allreduce_s: float = 0.0,
               transfer_s: float = 0.0) -> float:
    """Simulated steady-state minibatches/s of the toy pipeline, times its bound ``T``."""
    n = len(replicas)
    costs = SimCosts(
        forward_s=tuple(1.0 * m for m in replicas),
        backward_s=tuple(2.0 * m for m in replicas),
        allreduce_s=tuple(allreduce_s if m > 1 else 0.0 for m in replicas),
        activation_bytes=(transfer_s,) * (n - 1),
        bandwidth=1.0 if transfer_s else math.inf,
    )
    schedule = build_schedule(replicas, ScheduleKind.PIPEDREAM, 60 * math.lcm(*replicas))
    result = simulate_schedule(schedule, costs, record_events=False)
    return float(result.steady_throughput_minibatches_per_s) * _PERIOD


def balanced_time(replicas: Sequence[int], counts: Sequence[int] | None,
                  allreduce_s: float) -> tuple[float, float]:
    """Simulated and planned seconds per minibatch of stages balanced at ``3 / R`` (``R`` the
    most replicas), each replicated one all-reducing for ``allreduce_s``."""
    most = max(replicas)
    fwd = tuple(r / most for r in replicas)
    costs = SimCosts(forward_s=fwd, backward_s=tuple(2 * f for f in fwd),
                     allreduce_s=tuple(allreduce_s if r > 1 else 0.0 for r in replicas),
                     allreduce_delay_s=tuple(_DELAY if r > 1 else 0.0 for r in replicas))
    planned = max(max(3 * f, f + _DELAY + allreduce_s if r > 1 else 0.0) / r
                  for f, r in zip(fwd, replicas, strict=True))
    schedule = build_schedule(replicas, ScheduleKind.PIPEDREAM, 50 * most * len(replicas),
                              in_flight=counts)
    result = simulate_schedule(schedule, costs, record_events=False)
    return 1 / float(result.steady_throughput_minibatches_per_s), planned


def _random_study(trials: int) -> None:
    """How many random pipelines reach the bound under each count (module doc)."""
    pipelines = [tuple(rnd.randint(1, 6) for _ in range(rnd.randint(2, 5)))
                 for rnd in [random.Random(0)] for _ in range(trials)]
    print(f"\n{trials} random pipelines per all-reduce: how many reach the planner's bound")
    print(f"{'counts':>26}  {'AR = F/2':>9}  {'AR = F':>7}  {'AR = 2F':>8}")
    for name, join, aligned in _COUNTS:
        reached = []
        for allreduce in (0.5, 1.0, 2.0):
            times = [balanced_time(r, in_flight_counts(r, join, aligned=aligned), allreduce)
                     for r in pipelines]
            reached.append(sum(sim <= 1.02 * planned for sim, planned in times))
        print(f"{name:>26}  {reached[0]:9d}  {reached[1]:7d}  {reached[2]:8d}")


def _leads() -> None:
    """The fewest minibatches in flight stage ``a`` needs over stage ``b`` (module doc)."""
    print("\nlead of a stage of a replicas over the next of b: the least that reaches the bound")
    print(f"{'a-b':>6}  {'needed':>8}  {'rule':>5}")
    for a, b in _PAIRS:
        held = 4 * b  # the next stage's total: four rounds of it
        need = None
        for n0 in range(-(-held // a), -(-(held + 3 * (a + b)) // a) + 1):
            try:
                sim, planned = balanced_time((a, b, 1), (n0, 4, 1), 1.0)
            except ScheduleError:  # a count that deadlocks reaches nothing
                continue
            if sim <= 1.02 * planned:
                need = a * n0 - held
                break
        rule = -(-(held + round_lead(a, b)) // a) * a - held  # whole minibatches a replica
        print(f"{a}-{b:<4}  {need if need is not None else '-':>8}  {rule:>5}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _docs.add_argument(parser)
    args = parser.parse_args(argv)
    tee = _docs.capture(args)
    print(f"{'replicas':>10}  {'no comm':>8}  {'all-reduce = T':>14}  {'transfer = T':>12}")
    for replicas in CONFIGS:
        row = (efficiency(replicas), efficiency(replicas, allreduce_s=_PERIOD),
               efficiency(replicas, transfer_s=_PERIOD))
        config = "-".join(map(str, replicas))
        print(f"{config:>10}  {row[0]:8.0%}  {row[1]:14.0%}  {row[2]:12.0%}")
    _random_study(50)
    _leads()
    _docs.finish(tee, "schedule-efficiency", __file__, argv)


if __name__ == "__main__":
    main()

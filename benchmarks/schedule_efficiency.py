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
It runs in a few seconds; the simulation is deterministic, so one run is the figure.

    python benchmarks/schedule_efficiency.py [--write-docs]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import _docs

from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.simulation.simulator import SimCosts, simulate_schedule

__all__ = ["efficiency", "main"]

CONFIGS = ((1, 1), (2, 2), (2, 1), (1, 2), (4, 3), (3, 4), (2, 2, 2), (1, 2, 1), (1, 4, 1),
           (2, 4, 3, 1))
_PERIOD = 3.0


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
    _docs.finish(tee, "schedule-efficiency", __file__, argv)


if __name__ == "__main__":
    main()

"""How fast schedules are built (with validation) and simulated on 64 workers.

1,000 minibatches on a 64-worker plan should take seconds, not minutes.
Plans: a 64-stage straight pipeline, 16 stages x 4 replicas and 64-way data
parallelism, plus 1F1B-flush and GPipe on 16 stages with microbatches.
Stage costs are VGG-like (uneven), transfers go over cluster links. Prints a
table; times are the median and spread (max - min) of ``--repeat`` runs.

    python benchmarks/bench_simulator.py [--minibatches 1000] [--repeat 3] [--write-docs]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Sequence

import _docs

from dreampipe.planning.topology import Topology
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.simulation.simulator import SimCosts, simulate_schedule

__all__ = ["main"]

_CASES: tuple[tuple[str, tuple[int, ...], ScheduleKind, int], ...] = (
    ("64 straight", (1,) * 64, ScheduleKind.PIPEDREAM, 1),
    ("16 x 4", (4,) * 16, ScheduleKind.PIPEDREAM, 1),
    ("dp 64", (64,), ScheduleKind.DP, 64),
    ("16 straight", (1,) * 16, ScheduleKind.FLUSH, 8),
    ("16 straight", (1,) * 16, ScheduleKind.GPIPE, 8),
)


def _costs(replicas: Sequence[int], fraction: float) -> SimCosts:
    n = len(replicas)
    weights = [1.0 + math.sin(s) ** 2 for s in range(n)]
    return SimCosts(
        forward_s=tuple(0.010 * w * fraction for w in weights),
        backward_s=tuple(0.020 * w * fraction for w in weights),
        activation_bytes=tuple(4e6 * fraction for _ in range(n - 1)),
        bandwidth=Topology.parse("8x8", ["50GB/s", "25Gbps"]),
        allreduce_s=tuple(0.005 if r > 1 else 0.0 for r in replicas),
        parameter_bytes=(1e7,) * n,
        stash_bytes=(4e7 * fraction,) * n,
        microbatch_fraction=fraction,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minibatches", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    _docs.add_argument(parser)
    args = parser.parse_args(argv)
    tee = _docs.capture(args)
    print(f"{'plan':<12} {'schedule':<10} {'microbatches':>12} {'actions':>8} {'build s':>13} "
          f"{'simulate s':>13} {'total s':>13} {'mb/s':>8} {'bubble':>7}")
    for name, replicas, kind, per_update in _CASES:
        microbatches = (args.minibatches * per_update if kind is not ScheduleKind.DP
                        else args.minibatches)
        fraction = 1.0 if kind in (ScheduleKind.PIPEDREAM, ScheduleKind.DP) else 1 / per_update
        per = per_update if kind is not ScheduleKind.DP else replicas[0]
        microbatches = -(-microbatches // per) * per
        build_s: list[float] = []
        sim_s: list[float] = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            schedule = build_schedule(replicas, kind, microbatches, per)
            t1 = time.perf_counter()
            result = simulate_schedule(schedule, _costs(replicas, fraction))
            t2 = time.perf_counter()
            build_s.append(t1 - t0)
            sim_s.append(t2 - t1)
        actions = sum(len(a) for a in schedule.actions)
        total_s = [b + s for b, s in zip(build_s, sim_s, strict=True)]
        print(f"{name:<12} {kind.value:<10} {microbatches:>12} {actions:>8} {_spread(build_s):>13} "
              f"{_spread(sim_s):>13} {_spread(total_s):>13} "
              f"{result.throughput_minibatches_per_s:>8.2f} {result.bubble_fraction:>7.3f}")
    _docs.finish(tee, "simulator", __file__, argv)


def _spread(seconds: list[float]) -> str:
    """``median ±(max - min)``."""
    return f"{statistics.median(seconds):.2f} ±{max(seconds) - min(seconds):.2f}"


if __name__ == "__main__":
    main()

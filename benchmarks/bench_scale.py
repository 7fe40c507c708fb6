"""Planning at scale: every shipped profile on 1024 workers, as ``dreampipe plan`` runs it.

Each bundled PipeDream profile (or each ``--profile``) is planned on
``8x128``, ``128x8`` and ``64x16`` (``-b 300GB/s -b 25Gbps``: inner level at
300 GB/s, servers joined at 25 Gbps), and the plan's PipeDream schedule is
then simulated as the CLI's check does. Each case runs ``--repeat`` times; the
table shows the median and spread (max - min) of the planner alone and of
planner plus check, the plan chosen and the workers it uses, and PASS/FAIL
against the targets: ResNet on ``128x8`` plans in under 1 s, every case with
its check in under 30 s. Takes a few minutes; ``--quick`` runs ResNet and GNMT
on ``128x8`` only.

    python benchmarks/bench_scale.py [--quick] [--repeat 3] [--profile PROFILE ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _docs

from dreampipe.cli.plan import confirm_by_simulation
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.topology import Topology
from dreampipe.profiling.bundled import bundled_profiles
from dreampipe.profiling.load import load_graph

__all__ = ["main"]

SHAPES = ("8x128", "128x8", "64x16")
BANDWIDTHS = ("300GB/s", "25Gbps")
#: Seconds: the planner alone for ResNet on 128x8; any case with its check.
PLAN_TARGET_S, TOTAL_TARGET_S = 1.0, 30.0


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ±{max(values) - min(values):5.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", action="append", metavar="PROFILE",
                        help="a profile file or pipedream:NAME, repeatable (default: every "
                             "bundled profile)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="ResNet and GNMT on 128x8 only")
    _docs.add_argument(parser)
    args = parser.parse_args(argv)
    tee = _docs.capture(args)
    graphs = [load_graph(p) for p in args.profile or [b.spec for b in bundled_profiles()]]
    cases = [(g, shape) for g in graphs for shape in SHAPES]
    if args.quick:
        cases = [(g, "128x8") for g in graphs if g.model in ("resnet18", "gnmt")]
    print(f"{'model':<10} {'topology':<8} {'plan s (median ±spread)':>24} "
          f"{'with check s':>16} {'workers':>7}  {'verdict':<7} config")
    failed = 0
    for graph, shape in cases:
        topo = Topology.parse(shape, list(BANDWIDTHS))
        plan_s, total_s = [], []
        for _ in range(args.repeat):
            start = time.perf_counter()
            result = plan_pipeline(graph, topo)
            plan_s.append(time.perf_counter() - start)
            confirm_by_simulation(result, graph, topo)
            total_s.append(time.perf_counter() - start)
        ok = statistics.median(total_s) < TOTAL_TARGET_S
        if graph.model.startswith("resnet") and shape == "128x8":
            ok = ok and statistics.median(plan_s) < PLAN_TARGET_S
        failed += not ok
        print(f"{graph.model:<10} {shape:<8} {_spread(plan_s):>24} {_spread(total_s):>16} "
              f"{result.workers_used:>7}  {'PASS' if ok else 'FAIL':<7} {result.config}")
    print(f"targets: ResNet on 128x8 plans in < {PLAN_TARGET_S:g} s; every case with its check "
          f"in < {TOTAL_TARGET_S:g} s. {failed} of {len(cases)} cases fail")
    _docs.finish(tee, "scale", __file__, argv)


if __name__ == "__main__":
    main()

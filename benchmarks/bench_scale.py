"""Planning at scale: every shipped profile on 1024 workers, as ``dreampipe plan`` runs it.

Each shared PipeDream profile is planned on ``8x128``, ``128x8`` and ``64x16``
(``-b 300GB/s -b 25Gbps``: inner level at 300 GB/s, servers joined at
25 Gbps), and the plan's PipeDream schedule is then simulated as the CLI's
check does. Each case runs ``--repeat`` times; the table shows the median
and spread (max - min) of the planner alone and of planner plus check, the
plan chosen and the workers it uses, and PASS/FAIL against the targets:
ResNet on ``128x8`` plans in under 1 s, every case with its check in under
30 s. Takes a few minutes; ``--quick`` runs ResNet and GNMT on ``128x8`` only.

    python benchmarks/bench_scale.py [--quick] [--repeat 3] [--profiles DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import _docs

from dreampipe.cli.plan import confirm_by_simulation
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.topology import Topology
from dreampipe.profiling.load import load_graph

__all__ = ["main"]

SHAPES = ("8x128", "128x8", "64x16")
BANDWIDTHS = ("300GB/s", "25Gbps")
#: Seconds: the planner alone for ResNet on 128x8; any case with its check.
PLAN_TARGET_S, TOTAL_TARGET_S = 1.0, 30.0
_PROFILE_DIRS = (
    Path(__file__).resolve().parents[2] / "shared/profiles/pipedream",
    Path("/work/shared/profiles/pipedream"),
)


def _default_profiles() -> Path:
    """The first of :data:`_PROFILE_DIRS` that holds the profiles (else the first)."""
    return next((d for d in _PROFILE_DIRS if (d / "vgg16.txt").is_file()), _PROFILE_DIRS[0])


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ±{max(values) - min(values):5.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profiles", type=Path, default=_default_profiles(),
                        help="folder of PipeDream graph.txt profiles (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="ResNet and GNMT on 128x8 only")
    _docs.add_argument(parser)
    args = parser.parse_args(argv)
    tee = _docs.capture(args)
    paths = sorted(p for p in args.profiles.glob("*.txt") if p.stem != "LICENSE")
    if not paths:
        parser.error(f"no PipeDream profiles (*.txt) in {args.profiles}; pass --profiles DIR")
    cases = [(p, shape) for p in paths for shape in SHAPES]
    if args.quick:
        cases = [(p, "128x8") for p in paths if p.stem in ("resnet18", "gnmt")]
    print(f"{'model':<10} {'topology':<8} {'plan s (median ±spread)':>24} "
          f"{'with check s':>16} {'workers':>7}  {'verdict':<7} config")
    failed = 0
    for path, shape in cases:
        graph = load_graph(path)
        topo = Topology.parse(shape, list(BANDWIDTHS))
        plan_s, total_s = [], []
        for _ in range(args.repeat):
            start = time.perf_counter()
            result = plan_pipeline(graph, topo)
            plan_s.append(time.perf_counter() - start)
            confirm_by_simulation(result, graph, topo)
            total_s.append(time.perf_counter() - start)
        ok = statistics.median(total_s) < TOTAL_TARGET_S
        if path.stem.startswith("resnet") and shape == "128x8":
            ok = ok and statistics.median(plan_s) < PLAN_TARGET_S
        failed += not ok
        print(f"{path.stem:<10} {shape:<8} {_spread(plan_s):>24} {_spread(total_s):>16} "
              f"{result.workers_used:>7}  {'PASS' if ok else 'FAIL':<7} {result.config}")
    print(f"targets: ResNet on 128x8 plans in < {PLAN_TARGET_S:g} s; every case with its check "
          f"in < {TOTAL_TARGET_S:g} s. {failed} of {len(cases)} cases fail")
    _docs.finish(tee, "scale", __file__, argv)


if __name__ == "__main__":
    main()

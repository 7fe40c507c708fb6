"""The gap a heuristic plan states, per profile and topology, as ``dreampipe plan`` plans.

Every bundled profile on ``16x8`` and ``128x8`` (the default links) and five
``gpt:`` shapes (GPT-2 small and large, Megatron-LM's 1.3B, a 9.7B and GPT-3 175B)
on 16 and 128 servers of 8 GPUs, ``dgx-a100`` and ``p3.16xlarge`` (A100s on 200 Gbps
a GPU, V100s on 25 Gbps a server; their device's memory), under the options
``dreampipe plan`` passes by default (recompute and mixed splits on); ``--memory``
adds the topology's memory to the bundled profiles. Each row: the layers, the plan's
time, the bound, the gap it states, the gap the whole compute over the workers alone
would give (``time / (C / W) - 1``), and the planner's median seconds over
``--repeat`` runs with their spread.
A plan that does not fit says so.

    python benchmarks/gap_table.py [--memory] [--repeat 3] [--only TEXT ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

from dreampipe.cli.links import memory_limit, profile_on
from dreampipe.errors import PlanError
from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.topology import Topology
from dreampipe.profiling.bundled import bundled_profiles

__all__ = ["GPT_SHAPES", "cases", "main"]

GPT_SHAPES = ("gpt:layers=12,hidden=768,heads=12,seq=1024,vocab=50257",
              "gpt:layers=36,hidden=1280,heads=20,seq=1024,vocab=50257",
              "gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200",
              "gpt:layers=48,hidden=4096,heads=32,seq=2048,vocab=51200",
              "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200")


def cases() -> list[tuple[str, str]]:
    """``(profile, topology)`` of every row."""
    out = [(b.spec, t) for b in bundled_profiles() for t in ("16x8", "128x8")]
    return out + [(g, f"{server}:{n}") for server in ("dgx-a100", "p3.16xlarge")
                  for g in GPT_SHAPES for n in (16, 128)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memory", action="store_true",
                        help="plan the bundled profiles under the topology's memory too")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=[],
                        help="rows whose profile or topology contains one of these")
    args = parser.parse_args(argv)
    print("| profile | topology | layers | time ms | bound ms | stated gap | compute-only gap "
          "| plan s |")
    print("|---|---|---|---|---|---|---|---|")
    for spec, shape in cases():
        if args.only and not any(x in spec + shape for x in args.only):
            continue
        topo = Topology.parse(shape)
        graph = profile_on(spec, topo)
        opts = PlanOptions(memory_bytes=memory_limit("yes" if args.memory else None, graph,
                                                     topo),
                           recompute=True, mixed_splits=True)
        name = spec.split(",vocab")[0]
        seconds = []
        try:
            for _ in range(args.repeat):
                start = time.perf_counter()
                plan = plan_pipeline(graph, topo, opts)
                seconds.append(time.perf_counter() - start)
        except PlanError:
            print(f"| {name} | {shape} | {len(graph)} | no plan fits | | | | |")
            continue
        fine = RangeCosts.of(graph)
        compute = float(fine.compute_s[0, fine.n - 1]) / topo.num_workers
        t = plan.time_per_minibatch_s
        gap = plan.optimality_gap
        print(f"| {name} | {shape} | {len(graph)} | {1e3 * t:.3f} | {1e3 * t / (1 + gap):.3f} | "
              f"{100 * gap:.1f}% | {100 * (t / compute - 1):.1f}% | "
              f"{statistics.median(seconds):.2f} ±{max(seconds) - min(seconds):.2f} |")


if __name__ == "__main__":
    main()

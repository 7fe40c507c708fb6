"""How long planning takes: every bundled PipeDream profile on cluster-a, cluster-b and 64x8.

PipeDream's own optimizer needs about 19 s for ResNet-50 (~180 layers) on a
4x4 topology; dreampipe should stay well under a second at that size. Two
synthetic chains of ResNet-50's size stand in for it (the bundled profiles
stop at 71 layers). Prints a table; times are the median and spread of ``--repeat`` runs.
``--profile`` plans other profiles instead (files or ``pipedream:NAME``).

    python benchmarks/bench_planner.py [--profile PROFILE ...] [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import _docs

from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.topology import Topology
from dreampipe.profiling.bundled import bundled_profiles
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.profiling.load import load_graph

__all__ = ["main", "synthetic_chain"]

TOPOLOGIES = ("cluster-a", "cluster-b", "64x8")


def synthetic_chain(n: int, seed: int = 0) -> LayerGraph:
    """A chain shaped like a CNN: activations shrink, weights grow along the model."""
    rng = random.Random(seed)
    layers = []
    for i in range(n):
        depth = i / max(1, n - 1)
        layers.append(Layer(
            f"layer{i}", rng.uniform(0.5, 4.0), rng.uniform(1.0, 8.0),
            int(4e8 * (1 - depth) ** 2 * rng.uniform(0.5, 1.5)) + 10**5,
            int(1e7 * depth ** 2 * rng.uniform(0.0, 2.0)),
        ))
    return LayerGraph.chain(layers, batch_size=64, model=f"synth{n}-s{seed}")


def _time(graph: LayerGraph, topo: Topology, repeat: int) -> tuple[str, str, float, float]:
    """Planning seconds as ``median ±spread``, the config, its time per minibatch, x DP."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = plan_pipeline(graph, topo)
        times.append(time.perf_counter() - start)
    secs = f"{statistics.median(times):.3f} ±{max(times) - min(times):.3f}"
    return secs, result.config, result.time_per_minibatch_s, result.speedup_over("dp")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", action="append", metavar="PROFILE",
                        help="a profile file or pipedream:NAME, repeatable (default: every "
                             "bundled profile)")
    parser.add_argument("--repeat", type=int, default=3)
    _docs.add_argument(parser)
    args = parser.parse_args(argv)
    tee = _docs.capture(args)
    graphs = [load_graph(p) for p in args.profile or [b.spec for b in bundled_profiles()]]
    graphs += [synthetic_chain(180, seed=1), synthetic_chain(180, seed=2)]
    print(f"{'model':<12} {'layers':>6} {'topology':<10} {'plan s':>15} {'ms/mb':>8} "
          f"{'x dp':>7}  config")
    for graph in graphs:
        for name in TOPOLOGIES:
            secs, config, tpm, speedup = _time(graph, Topology.parse(name), args.repeat)
            print(f"{graph.model:<12} {len(graph):>6} {name:<10} {secs:>15} {tpm * 1e3:>8.1f} "
                  f"{speedup:>7.2f}  {config}")
    _docs.finish(tee, "planner", __file__, argv)


if __name__ == "__main__":
    main()

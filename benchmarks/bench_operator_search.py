"""The operator search on a 100-layer chain: is it interactive at 2, 4 and 8 workers?

The chain alternates 50 Linears of 4096x4096 (64 MB of fp32 weights, 16 MB
of output per minibatch) with 50 GELUs, on a 100 GB/s link with 5 us per
message round, as in a server. Each case runs without a memory limit and
under one that forces most layers off a whole-weights split; the table shows
the median search time with its spread (max - min) over ``--repeat`` runs,
the splits chosen and the time per minibatch they predict.

    python benchmarks/bench_operator_search.py [--repeat 5] [--write-docs]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Sequence

import _docs

from dreampipe.planning.operator_search import Link, search_splits
from dreampipe.profiling.graph import Layer, LayerGraph

__all__ = ["chain", "main"]

_MB = 1 << 20


def chain(blocks: int = 50) -> LayerGraph:
    """``blocks`` x (Linear 4096x4096, GELU): 2 x ``blocks`` layers."""
    layers: list[Layer] = []
    for i in range(blocks):
        layers.append(Layer(f"fc{i}", 2.0, 4.0, 16 * _MB, 64 * _MB, "Linear(4096, 4096)"))
        layers.append(Layer(f"gelu{i}", 0.2, 0.3, 16 * _MB, 0, "GELU()"))
    return LayerGraph.chain(layers, batch_size=1024, model=f"chain{2 * blocks}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    _docs.add_argument(parser)
    args = parser.parse_args(argv)
    tee = _docs.capture(args)
    graph = chain()
    link = Link(bandwidth=100e9, latency_s=5e-6)
    print(f"{graph.model}: {len(graph)} layers, {graph.total_parameter_bytes() / 2**30:.1f} GiB "
          "of weights")
    print(f"{'workers':>7} {'memory limit':>13} {'search s (median ±spread)':>26} "
          f"{'ms / minibatch':>14}  splits")
    for t in (2, 4, 8):
        for limit in (None, 2.5 * graph.total_parameter_bytes() / t):
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                plan = search_splits(graph, t, link, limit)
                times.append(time.perf_counter() - start)
            spread = max(times) - min(times)
            shown = "none" if limit is None else f"{limit / 2**30:.2f} GiB"
            splits = ", ".join(f"{s.value} x{n}" for s, n in Counter(plan.splits).most_common())
            print(f"{t:>7} {shown:>13} {statistics.median(times):>17.3f} ±{spread:6.3f} "
                  f"{plan.time_s * 1e3:>14.2f}  {splits}")
    _docs.finish(tee, "operator-search", __file__, argv)


if __name__ == "__main__":
    main()

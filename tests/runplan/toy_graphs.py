"""Toy layer graphs the run's-plan tests price."""

from __future__ import annotations

from dreampipe.profiling.graph import Layer, LayerGraph

__all__ = ["toy_graph"]


def toy_graph(times_ms: list[float], batch: int = 32) -> LayerGraph:
    """A chain of layers taking ``times_ms`` each (a third forward), 4 MiB of weights each."""
    layers = tuple(
        Layer(f"l{i}", t / 3, 2 * t / 3, 4 * batch * 1024, 4 * 1024 * 1024)
        for i, t in enumerate(times_ms)
    )
    edges = tuple((i, i + 1) for i in range(len(layers) - 1))
    return LayerGraph(layers, edges, batch, "toy")

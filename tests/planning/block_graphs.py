"""A hypothesis strategy of profiles with blocks, for the synchronous planner's tests."""

from __future__ import annotations

from hypothesis import strategies as st

from dreampipe.profiling.graph import Layer, LayerGraph

__all__ = ["block_graphs"]


@st.composite
def block_graphs(draw: st.DrawFn, most: int = 4, weights: tuple[int, ...] = (10**6, 10**7)
                 ) -> LayerGraph:
    """An embedding, two to ``most`` blocks of two layers each (named as a profile by shape
    names them, ``b<k>.``) of ``weights`` bytes each and a head."""
    layers = [Layer("embed", 0.1, 0.2, 10**6, 10**6, "Embedding")]
    for k in range(draw(st.integers(2, most))):
        for part in ("attn", "mlp"):
            t = draw(st.floats(0.5, 5.0))
            layers.append(Layer(f"b{k}.{part}", t, 2 * t, draw(st.sampled_from([10**6, 10**8])),
                                draw(st.sampled_from(weights)), "Linear(1)"))
    layers.append(Layer("head", 1.0, 2.0, 10**6, 10**7, "Linear(2)"))
    return LayerGraph.chain(layers, batch_size=4, model="blocks")

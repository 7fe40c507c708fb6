"""What a layer costs per call whatever its batch: a profile timed at two batch sizes.

A layer's time is not in proportion to its batch: each call pays a fixed part
(kernel launches, the framework's dispatch, the runtime's bookkeeping) beside
the part that grows with the samples. A microbatch of a quarter of the profiled
batch takes more than a quarter of its time, and on a small model far more, so
a schedule of many small microbatches is slower than proportion says. The
profile is therefore taken again at a small batch and kept in the graph's meta
(:func:`with_small_batch`); :func:`at_fraction` reads a time at any batch up
to the profiled one on the line through the two, and above it in proportion:
no fixed part was measured there, and the planner's floors, which scale the
profiled times, stay below every time read so (docs/design.md §9.1). A profile
without a small batch scales in proportion throughout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dreampipe.profiling.graph import Layer, LayerGraph

__all__ = ["SMALL_BATCH", "at_fraction", "default_small_batch", "fixed_parts", "fixed_share",
           "layer_times", "meta_at_fraction", "small_batch_of", "with_small_batch"]

#: The graph meta key of the profile at the small batch.
SMALL_BATCH = "small_batch"
#: A profile is taken again at this share of its batch (:func:`default_small_batch`).
_SMALL_SHARE = 8
#: The whole-model figures of the meta read on the line too (the runtime's overhead
#: factors are turned into milliseconds first).
_LOSS = ("loss_forward_ms", "loss_backward_ms")


def with_small_batch(graph: LayerGraph, small: LayerGraph) -> LayerGraph:
    """``graph`` with ``small`` (the same model profiled at fewer samples) kept in its meta:
    each layer's times, the runtime's overhead and the loss's, as ``small`` measured them."""
    if len(small.layers) != len(graph.layers) or not 0 < small.batch_size < graph.batch_size:
        return graph
    kept: dict[str, Any] = {
        "batch_size": small.batch_size,
        "forward_ms": [round(x.forward_ms, 5) for x in small.layers],
        "backward_ms": [round(x.backward_ms, 5) for x in small.layers],
        "weight_grad_ms": [round(_weight_ms(x), 5) for x in small.layers]}
    kept |= {k: small.meta[k] for k in ("runtime_forward", "runtime_backward", *_LOSS)
             if k in small.meta}
    return replace(graph, meta={**graph.meta, SMALL_BATCH: kept})


def small_batch_of(graph: LayerGraph) -> dict[str, Any] | None:
    """The small batch's figures :func:`with_small_batch` kept, None where there are none."""
    found = graph.meta.get(SMALL_BATCH)
    return found if isinstance(found, dict) and found.get("batch_size") else None


def default_small_batch(batch: int) -> int:
    """The batch a profile at ``batch`` is taken again at by default: an eighth of it, as
    small as the microbatches of a deep pipeline's schedule; 0 where that is no smaller."""
    small = max(1, batch // _SMALL_SHARE)
    return small if small < batch else 0


def _fixed(big_ms: float, small_ms: float, big: int, small: int) -> float:
    """Where the line through ``(small, small_ms)`` and ``(big, big_ms)`` meets batch 0,
    kept between 0 and both times."""
    slope = (big_ms - small_ms) / (big - small)
    return min(max(small_ms - slope * small, 0.0), small_ms, big_ms)


def at_fraction(big_ms: float, small_ms: float, big: int, small: int, fraction: float
                ) -> float:
    """A time at ``fraction`` of batch ``big``: up to ``big``, on the line through
    ``(small, small_ms)`` and ``(big, big_ms)``, the fixed part (where the line meets batch
    0, between 0 and ``small_ms``) plus the rest in proportion; above it, in proportion
    (module doc)."""
    return big_ms * fraction + _fixed(big_ms, small_ms, big, small) * fixed_share(fraction)


def fixed_share(fraction: float) -> float:
    """How much of a call's fixed part a microbatch ``fraction`` of the profiled batch
    pays beyond its share in proportion: ``1 - fraction`` up to the profiled batch, none
    above it (module doc)."""
    return max(0.0, 1.0 - fraction)


def fixed_parts(graph: LayerGraph) -> list[tuple[float, float, float]] | None:
    """Each layer's fixed (forward, backward, weight gradient) milliseconds a call, from the
    small batch (:func:`at_fraction`); None where the profile has none."""
    small = small_batch_of(graph)
    if small is None:
        return None
    b, s = graph.batch_size, int(small["batch_size"])
    return [(_fixed(x.forward_ms, float(small["forward_ms"][i]), b, s),
             _fixed(x.backward_ms, float(small["backward_ms"][i]), b, s),
             _fixed(_weight_ms(x), float(small["weight_grad_ms"][i]), b, s))
            for i, x in enumerate(graph.layers)]


def _weight_ms(x: Layer) -> float:
    return x.weight_grad_ms if x.weight_grad_ms is not None else x.backward_ms / 2


def layer_times(graph: LayerGraph, fraction: float) -> list[tuple[float, float, float]]:
    """Each layer's (forward, backward, weight gradient) milliseconds at ``fraction`` of the
    profiled batch: with its fixed part where the profile has a small batch
    (:func:`at_fraction`), else in proportion."""
    fixed = fixed_parts(graph)
    keep = fixed_share(fraction)
    return [(x.forward_ms * fraction + (fixed[i][0] * keep if fixed else 0.0),
             x.backward_ms * fraction + (fixed[i][1] * keep if fixed else 0.0),
             _weight_ms(x) * fraction + (fixed[i][2] * keep if fixed else 0.0))
            for i, x in enumerate(graph.layers)]


def meta_at_fraction(graph: LayerGraph, fraction: float) -> dict[str, float]:
    """The runtime's overhead factors and the loss's milliseconds of ``graph.meta`` as at
    ``fraction`` of the profiled batch: the overhead, in milliseconds over the layers' time,
    and the loss on the line through the small batch (in proportion without one; the
    factors then as measured)."""
    meta, small = graph.meta, small_batch_of(graph)
    out: dict[str, float] = {}
    for key in _LOSS:
        if key in meta:
            big_ms = float(meta[key])
            out[key] = (big_ms * fraction if small is None or key not in small else at_fraction(
                big_ms, float(small[key]), graph.batch_size, int(small["batch_size"]),
                fraction))
    for key, column in (("runtime_forward", "forward_ms"), ("runtime_backward", "backward_ms")):
        if key not in meta:
            continue
        if small is None or key not in small:
            out[key] = float(meta[key])
            continue
        layers_b = sum(getattr(x, column) for x in graph.layers)
        layers_s = sum(float(t) for t in small[column])
        layers_f = sum(t[0 if column == "forward_ms" else 1]
                       for t in layer_times(graph, fraction))
        over = at_fraction((float(meta[key]) - 1) * layers_b, (float(small[key]) - 1) * layers_s,
                           graph.batch_size, int(small["batch_size"]), fraction)
        out[key] = 1.0 + over / layers_f if layers_f > 0 else float(meta[key])
    return out

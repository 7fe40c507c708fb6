"""What a worker of a stage split over workers holds at most: :func:`split_peak`.

A split stage holds its share of each layer's weights, gradient and optimizer state, and
of what each layer keeps per microbatch, beside the stage's whole input, sends and
backward working set (:func:`~dreampipe.planning.operator_search.split_memory`). Its step
runs over its shares, with the optimizer's temporaries, after the backward's working set
is gone: the larger of the two peaks counts, as for an unsplit stage (:func:`with_step`;
docs/design.md §5.4).
"""

from __future__ import annotations

from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.operator_search import split_memory
from dreampipe.planning.plan import Stage
from dreampipe.planning.split_stage import layer_shares
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runtime.optimizer_step import StepBytes, stage_step_bytes

__all__ = ["split_peak", "with_step"]


def with_step(main: int, before: int, stepping: int, step: int, synchronous: bool) -> int:
    """A stage's peak with its step: ``main`` is its peak without it, ``before`` what that
    peak holds besides the backward's transients, ``stepping`` what it holds as it steps
    and ``step`` the step's temporaries. After a flush the step runs alone, so the larger
    peak counts; an asynchronous stage steps beside its other microbatches in flight, so
    the temporaries add where they exceed what the backward's transients held."""
    if synchronous:
        return max(main, stepping + step)
    return main + max(0, step - max(0, before - stepping))


def split_peak(graph: LayerGraph, st: Stage, *, versions: int, in_flight: int,
               optimizer_copies: float, stash: bool, synchronous: bool,
               microbatches_per_update: int, step: StepBytes, master_weights: bool) -> int:
    """Bytes a worker of split stage ``st`` holds at most, with ``versions`` of its weights,
    ``in_flight`` microbatches, ``optimizer_copies`` of its weights as state and its step's
    temporaries (``step``; 32-bit masters where ``master_weights``)."""
    def holding(flight: int) -> int:
        return split_memory(graph, st.first, st.last, st.splits, st.tensor_parallel, versions,
                            flight, optimizer_copies=optimizer_copies, stash=stash,
                            recompute=st.recompute)

    at_once = holding(in_flight)
    working = int(RangeCosts.of(graph).backward_working[st.first, st.last])
    stepping = holding(0 if synchronous else max(in_flight - 1, 0)) - working
    temporaries = round(stage_step_bytes(step, _shares(graph, st),
                                         master_weights=master_weights))
    main = at_once + _accumulated(graph, st, microbatches_per_update)
    return with_step(main, at_once, stepping, temporaries, synchronous)


def _shares(graph: LayerGraph, st: Stage) -> list[int]:
    """A worker's parameter sizes of split stage ``st`` as far as its profile knows them:
    each layer's largest parameter and the rest of the layer, at the share its split
    keeps of the layer's weights."""
    layers = graph.layers[st.first : st.last + 1]
    out = []
    for layer, share in zip(layers, layer_shares(layers, st.splits, st.tensor_parallel),
                            strict=True):
        kept = share.weight_bytes / layer.parameter_bytes if layer.parameter_bytes else 0.0
        out += [b for b in (round(layer.largest_parameter * kept),
                            round((layer.parameter_bytes - layer.largest_parameter) * kept))
                if b]
    return out


def _accumulated(graph: LayerGraph, st: Stage, microbatches_per_update: int) -> int:
    """The weight gradient autograd makes before adding it to ``.grad`` in a split stage
    whose update spans several microbatches (split layers accumulate with autograd's kernels,
    not in place): the largest layer's share."""
    if microbatches_per_update == 1:
        return 0
    shares = layer_shares(graph.layers[st.first : st.last + 1], st.splits, st.tensor_parallel)
    return max(round(x.weight_bytes) for x in shares)

"""A stage whose every layer is split over ``t`` workers of one server (operator partitioning).

When no layer plan fits the memory limit, :func:`dreampipe.planning.planner.plan_pipeline`
falls back to one such stage: it runs :func:`~dreampipe.planning.operator_search.search_splits`
for ``t = 2, 4, ...`` up to the workers of one server (:func:`split_widths`), on the
innermost level's link, and keeps the fastest split that fits (:func:`best_split`).
:func:`split_stage` turns the search's answer into a :class:`Stage`; the simulator reads
each worker's share of a split stage's layers with :func:`layer_shares`.
"""

from __future__ import annotations

from collections.abc import Sequence

from dreampipe.errors import PlanError
from dreampipe.planning.memory_terms import STATELESS, OptimizerTerms
from dreampipe.planning.operator_search import (
    Link,
    SplitPlan,
    search_splits,
    split_front,
    split_memory,
)
from dreampipe.planning.plan import Stage
from dreampipe.planning.splits import Split, SplitCost, op_kind, split_cost
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.quantities import format_bytes

__all__ = ["best_split", "layer_shares", "no_split_reason", "server_link",
           "smallest_split_bytes", "split_stage", "split_step_bytes", "split_widths",
           "unfit_lines"]


def split_widths(topology: Topology, all_workers: bool = False) -> list[int]:
    """The ``t`` tried: powers of two from 2 up to one server's workers (the innermost
    level); with ``all_workers`` only a ``t`` that uses every worker of the topology."""
    most = min(topology.levels[0].count, topology.num_workers)
    widths, t = [], 2
    while t <= most:
        widths.append(t)
        t *= 2
    return [t for t in widths if t == topology.num_workers] if all_workers else widths


def server_link(topology: Topology) -> Link:
    """The link between the workers of one server, which a split's collectives cross."""
    inner = topology.levels[0]
    return Link(inner.bandwidth, inner.latency)


def best_split(graph: LayerGraph, topology: Topology, memory_bytes: float,
               widths: Sequence[int], optimizer: OptimizerTerms = STATELESS
               ) -> SplitPlan | None:
    """The fastest split over any of ``widths`` that fits ``memory_bytes`` per worker
    with what ``optimizer`` holds beside the weights (ties: fewer workers); None when
    none fits or ``graph`` is not a chain."""
    if not graph.is_chain:
        return None
    best: SplitPlan | None = None
    for t in sorted(widths):
        found = _fitting(graph, t, server_link(topology), memory_bytes, optimizer)
        if found is not None and (best is None or found.time_s < best.time_s):
            best = found
    return best


#: Searches :func:`_fitting` runs at most, each under a tighter limit.
_TIGHTENINGS = 8


def _fitting(graph: LayerGraph, t: int, link: Link, memory_bytes: float,
             optimizer: OptimizerTerms) -> SplitPlan | None:
    """The fastest split over ``t`` whose whole need (:func:`_memory`) fits ``memory_bytes``.

    The search counts weights, gradients, state and kept tensors but not the stage's
    input, sends, working set and step temporaries, which the check adds; so where the
    split found needs more, the search runs again under a limit lower by the excess,
    until a split fits or none is left (the added terms barely depend on the split)."""
    limit = memory_bytes
    for _ in range(_TIGHTENINGS):
        try:
            found = search_splits(graph, t, link, limit, optimizer)
        except PlanError:
            return None
        excess = _memory(graph, found, optimizer) - memory_bytes
        if excess <= 0:
            return found
        limit = min(limit - excess, found.memory_bytes * (1 - 1e-9))
    return None


def smallest_split_bytes(graph: LayerGraph, topology: Topology, t: int,
                         optimizer: OptimizerTerms = STATELESS) -> int:
    """Bytes per worker (within 1%) of the least demanding split of ``graph`` over ``t``
    (beside what ``optimizer`` holds), as :func:`best_split` checks a split against a
    limit: with the stage's input, sends, working set and step temporaries."""
    link = server_link(topology)
    leanest = split_front(graph, t, link, optimizer)[1]
    lo, hi = 0.0, float(_memory(graph, leanest, optimizer))  # a limit of 0 fits none
    while hi - lo > 0.005 * hi:
        mid = (lo + hi) / 2
        found = _fitting(graph, t, link, mid, optimizer)
        if found is None:
            lo = mid
        else:
            hi = float(_memory(graph, found, optimizer))
    return round(hi)


def no_split_reason(graph: LayerGraph, topology: Topology, widths: Sequence[int],
                    optimizer: OptimizerTerms = STATELESS) -> str:
    """Why no tensor split fits: what the smallest over the largest of ``widths`` needs,
    or why there is none."""
    if not graph.is_chain:
        return f"a tensor split needs a chain of layers, which {graph.model or 'it'} is not"
    if not widths:
        return (f"a tensor split needs 2, 4, 8... workers inside one server (topology "
                f"{topology.shape} has {topology.levels[0].count}), and all "
                f"{topology.num_workers} of them when idle workers are not allowed")
    t = max(widths)
    return (f"the smallest tensor split (over {t} workers) needs about "
            f"{format_bytes(smallest_split_bytes(graph, topology, t, optimizer))}")


def layer_shares(layers: Sequence[Layer], splits: Sequence[Split], t: int) -> list[SplitCost]:
    """What each of ``layers``, split as ``splits`` over ``t`` workers, costs one worker."""
    return [split_cost(layer, op_kind(layer), split, t)
            for layer, split in zip(layers, splits, strict=True)]


def split_stage(graph: LayerGraph, found: SplitPlan, optimizer: OptimizerTerms = STATELESS
                ) -> Stage:
    """One stage over every layer of ``graph``, run as ``found`` says on its workers
    (its memory with what ``optimizer`` holds beside the weights).

    Forward+backward is the search's time, collectives included; the forward
    part is each layer's forward divided as its split divides its compute
    (by ``t``, or whole when replicated).
    """
    forward = 0.0
    for layer, share in zip(graph.layers, layer_shares(graph.layers, found.splits,
                                                       found.workers), strict=True):
        if layer.compute_ms > 0:
            forward += layer.forward_ms / 1e3 * share.compute_ms / layer.compute_ms
    return Stage(
        first=0, last=len(graph) - 1, replicas=1, ranks=(0,), compute_s=found.time_s,
        memory_bytes=_memory(graph, found, optimizer), forward_s=min(forward, found.time_s),
        tensor_parallel=found.workers, splits=found.splits,
    )


def _memory(graph: LayerGraph, found: SplitPlan, optimizer: OptimizerTerms) -> int:
    """Bytes per worker of the one split stage ``found``, one minibatch in flight, as the
    runtime's prediction counts them (:func:`~dreampipe.planning.operator_search.split_memory`)."""
    return split_memory(graph, 0, len(graph) - 1, found.splits, found.workers, 1, 1,
                        optimizer_copies=optimizer.state_copies,
                        step_bytes=_step_bytes(graph, found, optimizer))


def _step_bytes(graph: LayerGraph, found: SplitPlan, optimizer: OptimizerTerms) -> float:
    return split_step_bytes(graph.layers, found.splits, found.workers, optimizer)


def split_step_bytes(layers: Sequence[Layer], splits: Sequence[Split], t: int,
                     optimizer: OptimizerTerms) -> float:
    """``optimizer``'s bound on the step temporaries of a stage of ``layers`` split as
    ``splits`` over ``t`` workers, over each worker's share of its layers."""
    shares = [x.weight_bytes for x in layer_shares(layers, splits, t)]
    return float(optimizer.step_bytes(max(shares, default=0.0), sum(shares)))


def unfit_lines(needs: dict[str, int]) -> list[str]:
    """What a split plan's report says of the plans that did not fit, from
    :func:`~dreampipe.planning.planner.memory_needs`."""
    return [f"data parallelism: does not fit (needs {format_bytes(needs['dp'])} per worker)",
            f"layer pipeline: does not fit (the smallest needs {format_bytes(needs['pipeline'])}"
            " per worker)"]

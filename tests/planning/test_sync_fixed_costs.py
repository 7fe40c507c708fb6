"""A profile timed at a small batch too (``profiling/fixed_costs.py``): the synchronous
objective prices what each microbatch pays whatever its size as the simulator runs it,
its search stays exact, and it chooses fewer microbatches where that part is large."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.planning.layout import Layout
from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_objective import PipelineKind
from dreampipe.planning.sync_search import plan_sync
from dreampipe.planning.topology import Topology
from dreampipe.profiling.fixed_costs import with_small_batch
from dreampipe.profiling.graph import LayerGraph
from dreampipe.scheduling.actions import ScheduleKind

from .test_sync_objective import _as_brute_force, _chain, _graphs, _simulated

__all__: list[str] = []


def _timed_small(graph: LayerGraph, share: float, small: int = 1, weight: float = 0.5
                 ) -> LayerGraph:
    """``graph`` with a profile at ``small`` samples taking ``share`` of each time, its
    weight gradient ``weight`` of its backward (the profiled batch's: half)."""
    layers = tuple(replace(x, forward_ms=x.forward_ms * share, backward_ms=x.backward_ms * share,
                           weight_grad_ms=x.backward_ms * share * weight)
                   for x in graph.layers)
    return with_small_batch(graph, replace(graph, layers=layers, batch_size=small))


@settings(max_examples=60, deadline=None)
@given(_graphs(), st.sampled_from(["2", "4", "2x2"]), st.sampled_from([1e8, 1e10]),
       st.sampled_from([2, 4, 8]), st.sampled_from([tuple(PipelineKind), (PipelineKind.FLUSH,),
                                                    (PipelineKind.ZB_H1,)]),
       st.sampled_from([None, 3 * 10**8]), st.sampled_from([0.3, 0.6, 0.95]))
def test_brute_force_agrees_with_fixed_parts(graph: LayerGraph, shape: str, bandwidth: float,
                                             batch: int, kinds: tuple[PipelineKind, ...],
                                             memory: int | None, share: float) -> None:
    """The floors the search prunes by scale the profiled times: they stay below a
    microbatch that also pays a fixed part, so the program still finds brute force's."""
    topo = Topology.parse(shape, [f"{bandwidth}B/s"] * len(shape.split("x")))
    opts = SyncOptions(global_batch=batch, memory_bytes=memory, kinds=kinds,
                       tensor_split=False, training=Training(None, "adam"))
    _as_brute_force(_timed_small(graph, share), topo, opts)


@pytest.mark.parametrize(("kind", "b"), [
    *((k, b) for k in PipelineKind for b in (1, 2, 4)), (PipelineKind.FLUSH, 8),
    (PipelineKind.FLUSH, 16)])
def test_fixed_parts_take_the_simulators_time(kind: PipelineKind, b: int) -> None:
    """At microbatches below, at and above the profiled batch (8), as the simulator reads
    the two batches' line, the weight gradient on its own line (one microbatch of 16:
    ZB-H1's objective is a bound there)."""
    graph = _timed_small(_chain([3.0] * 8, [0] * 8, [0] * 8, batch=8), 0.5, weight=0.2)
    interleaved = kind is PipelineKind.INTERLEAVED
    topo = Topology.parse("2" if interleaved else "4", ["10GB/s"], None, ["0us"])
    opts = SyncOptions(global_batch=16, microbatch_size=b, kinds=(kind,),
                       layout=Layout(1, 2, 2) if interleaved else Layout(1, 4))
    found = plan_sync(graph, topo, opts)
    plan = found.plan()
    assert plan is not None
    took, _ = _simulated(graph, plan, topo, ScheduleKind(kind.value), 16, b,
                         found.virtual_stages)
    assert found.time_per_update_s == pytest.approx(took, rel=1e-9)
    proportional = plan_sync(_chain([3.0] * 8, [0] * 8, [0] * 8, batch=8), topo, opts)
    if b < 8:  # the fixed part is priced below the profiled batch only
        assert found.time_per_update_s > proportional.time_per_update_s * 1.01
    else:
        assert found.time_per_update_s == pytest.approx(proportional.time_per_update_s)


def test_a_large_fixed_part_chooses_fewer_microbatches_and_runs_faster() -> None:
    """In proportion, more microbatches only shrink the bubble; a call that costs most of
    its time whatever its size makes the search take fewer, which the simulator runs
    faster than the count proportion chooses."""
    plain = _chain([3.0] * 8, [0] * 8, [0] * 8, batch=8)
    graph = _timed_small(plain, 0.9)
    topo = Topology.parse("4", ["10GB/s"], None, ["0us"])
    opts = SyncOptions(global_batch=32, kinds=(PipelineKind.FLUSH,), layout=Layout(1, 4))
    found, naive = plan_sync(graph, topo, opts), plan_sync(plain, topo, opts)
    assert found.microbatches < naive.microbatches
    fast, slow = (found.plan(), naive.plan())
    assert fast is not None and slow is not None
    took = _simulated(graph, fast, topo, ScheduleKind.FLUSH, 32, found.microbatch_size)[0]
    other = _simulated(graph, slow, topo, ScheduleKind.FLUSH, 32, naive.microbatch_size)[0]
    assert took == pytest.approx(found.time_per_update_s, rel=1e-9) and took < other

"""The pipeline laid server by server: a plan it returns is faster, priced as any plan is,
fits, holds whole rounds in flight and keeps every stage inside one server."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.planning import coarsen as coarsen_module
from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.in_flight import IN_FLIGHT_CHOICES, in_flight_counts
from dreampipe.planning.level import Options
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.packed import with_packed
from dreampipe.planning.plan import Stage
from dreampipe.planning.pricing import price_stages, slowest
from dreampipe.planning.search import fastest, search_for
from dreampipe.planning.split_ranges import StageSplit, split_options
from dreampipe.planning.split_stage import split_widths
from dreampipe.planning.topology import Level, Topology
from dreampipe.profiling.graph import Layer, LayerGraph


def _chain(sizes: list[tuple[float, float, int, int]]) -> LayerGraph:
    return LayerGraph.chain([Layer(f"l{i}", f, b, a, w)
                             for i, (f, b, a, w) in enumerate(sizes)])


_LAYERS = st.lists(st.tuples(st.floats(0.1, 20.0), st.floats(0.1, 40.0),
                             st.sampled_from([10**4, 10**6, 10**7]),
                             st.sampled_from([0, 10**5, 10**7, 10**8])), min_size=2, max_size=9)


def _check(fine: RangeCosts, topo: Topology, found: tuple[Stage, ...],
           packed: tuple[Stage, ...], opts: Options, options: tuple[StageSplit, ...]) -> None:
    """``packed`` is faster than ``found``, each stage inside one server, priced as laid
    out, fitting its memory with whole rounds in flight."""
    assert slowest(packed) < slowest(found)
    server = topo.levels[0].count
    placements = [sorted(w + k for w in x.placement for k in range(x.tensor_parallel))
                  for x in packed]
    assert all(len({w // server for w in p}) == 1 for p in placements)
    ways = [next((s for s in options if s.t == x.tensor_parallel
                  and s.layers(x.first, x.last) == x.splits), None) for x in packed]
    again = price_stages(fine, topo, [(x.first, x.last) for x in packed], placements,
                         opts.sync, opts.memory_bytes, (), ways)
    assert np.isclose(slowest(again), slowest(packed))
    limit = opts.memory_bytes
    assert limit is None or max(x.memory_bytes for x in packed) <= limit
    replicas = [x.replicas for x in packed]
    widths = [x.tensor_parallel for x in packed]
    assert any(tuple(x.in_flight for x in packed) == in_flight_counts(replicas, j, widths, a)
               for j, a in IN_FLIGHT_CHOICES if a)


def test_stages_inside_servers_beat_the_hierarchys_plan_on_blocks() -> None:
    # searched on blocks, the hierarchy keeps the first two layers together; laid server by
    # server, every layer is searched: four workers on the first, four on the next two
    graph = _chain([(9.24, 31.19, 10**7, 10**8), (5.59, 14.87, 10**6, 10**8),
                    (1.16, 18.88, 10**4, 0)])
    topo = Topology((Level(4, 1e11, 1e-7), Level(2, 1e10, 1e-6)))
    fine = RangeCosts.of(graph)
    opts = PlanOptions(memory_bytes=int(fine.memory(0, fine.n - 1, 2))).search(fine.n)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(coarsen_module, "TABLE_WORK", 0)  # blocks of layers
        found = fastest(search_for(fine, topo), topo, [topo], opts)
    assert found is not None
    packed = with_packed(fine, topo, found, opts)
    assert [(x.first, x.last, x.replicas) for x in packed] == [(0, 0, 4), (1, 2, 4)]
    _check(fine, topo, found, packed, opts, ())


@settings(max_examples=100, deadline=None)
@given(_LAYERS, st.sampled_from([(4, 2), (2, 3), (8, 2), (2, 2, 2)]),
       st.sampled_from([1e9, 1e10]), st.sampled_from([1e-5, 1e-3]),
       st.sampled_from([None, 0.3, 1.0]), st.booleans())
def test_a_packed_plan_is_faster_priced_as_laid_out_and_fits(
        sizes: list[tuple[float, float, int, int]], shape: tuple[int, ...], bw: float,
        lat: float, memory: float | None, splits: bool) -> None:
    # against the hierarchy's plan on blocks of layers, where it may be beaten
    graph = _chain(sizes)
    topo = Topology(tuple(Level(c, bw * 10 ** (len(shape) - k), lat / 10 ** (len(shape) - k))
                          for k, c in enumerate(shape)))
    fine = RangeCosts.of(graph)
    limit = None if memory is None else max(1, int(memory * fine.memory(0, fine.n - 1, 2)))
    opts = PlanOptions(memory_bytes=limit).search(fine.n)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(coarsen_module, "TABLE_WORK", 0)
        found = fastest(search_for(fine, topo), topo, [topo], opts)
    if found is None:
        return
    options = split_options(graph, topo, split_widths(topo)) if splits else ()
    packed = with_packed(fine, topo, found, opts, options)
    if packed is not found:
        _check(fine, topo, found, packed, opts, options)

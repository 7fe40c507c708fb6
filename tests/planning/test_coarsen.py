"""Coarse profiles: their sums are the fine profile's, and a plan found on them says how far
from the optimum it may be, truthfully."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.planning import coarsen as coarsen_module
from dreampipe.planning.coarsen import block_starts, coarsen, exact_layers
from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.plan import Heuristic, Plan
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.topology import Level, Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.profiling.load import load_graph


@st.composite
def _graphs(draw: st.DrawFn, min_layers: int = 2, max_layers: int = 9) -> LayerGraph:
    n = draw(st.integers(min_layers, max_layers))
    layers = [
        Layer(f"l{i}", draw(st.floats(0.1, 20.0)), draw(st.floats(0.1, 40.0)),
              draw(st.integers(0, 10**8)), draw(st.sampled_from([0, 10**5, 10**7, 10**8])))
        for i in range(n)
    ]
    skips = draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3))
    edges = {(i, i + 1) for i in range(n - 1)} | {(a, b) for a, b in skips if b > a + 1}
    return LayerGraph(tuple(layers), tuple(sorted(edges)), model="random")


@settings(max_examples=60, deadline=None)
@given(_graphs(), st.integers(1, 9))
def test_coarse_sums_are_the_fine_sums_over_blocks(graph: LayerGraph, blocks: int) -> None:
    fine = RangeCosts.of(graph)
    starts = block_starts(fine, blocks)
    assert starts[0] == 0 and starts == sorted(set(starts)) and len(starts) <= max(blocks, 1)
    coarse = coarsen(fine, starts)
    ends = [*starts[1:], fine.n]
    for a in range(len(starts)):
        assert coarse.cut_bytes[a] == fine.cut_bytes[starts[a]]
        for b in range(a, len(starts)):
            i, j = starts[a], ends[b] - 1
            for name in ("compute_s", "forward_s", "weights", "activations", "stashed",
                         "working"):
                assert getattr(coarse, name)[a, b] == getattr(fine, name)[i, j], name
            assert coarse.memory(a, b, 3) == fine.memory(i, j, 3)
    assert coarse.layer_weights is not None and fine.layer_weights is not None
    assert np.sum(coarse.layer_weights) == pytest.approx(np.sum(fine.layer_weights))


@settings(max_examples=40, deadline=None)
@given(_graphs(min_layers=4), st.sampled_from([(2, 2), (4, 2), (2, 3)]),
       st.sampled_from([1e8, 1e9, 1e10]), st.sampled_from([1e8, 1e9]))
def test_a_coarse_plan_is_within_its_gap_of_the_optimum(
    graph: LayerGraph, shape: tuple[int, int], bw_in: float, bw_out: float,
) -> None:
    topo = Topology((Level(shape[0], bw_in, 1e-5), Level(shape[1], bw_out, 5e-5)))
    exact = plan_pipeline(graph, topo)
    # within the exact budget only a shared server link can leave the plan unproven
    assert set(exact.heuristics) <= {Heuristic.SHARED_LINKS}
    assert exact.heuristics or exact.optimality_gap == 0.0
    with pytest.MonkeyPatch.context() as patch:
        # no budget: the search runs on 2 blocks
        patch.setattr(coarsen_module, "TABLE_WORK", 0)
        assert exact_layers(topo) == 2
        rough = plan_pipeline(graph, topo)
    # the optimum lies in [exact / (1 + its gap), exact]; rough's gap must cover it
    best = exact.time_per_minibatch_s
    assert best / (1 + exact.optimality_gap) * (1 - 1e-9) <= rough.time_per_minibatch_s
    assert rough.time_per_minibatch_s <= best * (1 + rough.optimality_gap) * (1 + 1e-9)
    again = Plan.from_dict(rough.to_dict())
    assert again.optimality_gap == rough.optimality_gap


def test_bundled_profiles_plan_exactly_on_the_preset_clusters() -> None:
    for name in ("alexnet", "vgg16", "resnet18", "gnmt"):
        graph = load_graph(f"pipedream:{name}")
        for cluster in ("cluster-a", "cluster-b", "cluster-c"):
            assert len(graph) <= exact_layers(Topology.parse(cluster))


def test_large_clusters_search_fewer_layers() -> None:
    shapes = [Topology.parse(s) for s in ("cluster-a", "64x16", "128x8", "8x128")]
    sizes = [exact_layers(t) for t in shapes]
    assert sizes[0] > 300
    assert all(20 <= s <= 100 for s in sizes[1:])


def test_exact_searches_every_layer() -> None:
    graph = LayerGraph.chain([Layer(f"l{i}", 1.0 + i % 3, 2.0, 10**6 * (1 + i % 4), 10**6)
                              for i in range(12)])
    topo = Topology.parse("2x4")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(coarsen_module, "TABLE_WORK", 0)
        rough = plan_pipeline(graph, topo)
        exact = plan_pipeline(graph, topo, PlanOptions(exact=True))
    assert exact.optimality_gap == 0.0
    assert exact.time_per_minibatch_s == pytest.approx(plan_pipeline(graph, topo)
                                                       .time_per_minibatch_s, rel=1e-12)
    assert exact.time_per_minibatch_s <= rough.time_per_minibatch_s * (1 + 1e-12)


@pytest.mark.parametrize("model", ["gnmt", "resnet18"])
def test_blocks_find_the_exact_plan_of_bundled_profiles_on_128x8(model: str) -> None:
    graph = load_graph(f"pipedream:{model}")
    topo = Topology.parse("128x8", ["300GB/s", "25Gbps"])
    rough = plan_pipeline(graph, topo)
    assert rough.optimality_gap > 0  # more layers than 128x8's tables take
    assert Heuristic.LAYER_BLOCKS in rough.heuristics
    exact = plan_pipeline(graph, topo, PlanOptions(exact=True))
    # every layer searched; on 1,024 workers the ranges still run on a grid of workers
    assert exact.heuristics == (Heuristic.WORKER_GRID,)
    assert rough.time_per_minibatch_s == pytest.approx(exact.time_per_minibatch_s, rel=1e-9)
    assert rough.time_per_minibatch_s <= exact.time_per_minibatch_s * (1 + rough.optimality_gap)

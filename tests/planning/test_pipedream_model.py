"""``CostModel.PIPEDREAM``: PipeDream's optimizer term for term, its published rows, brute force."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.errors import ConfigError
from dreampipe.planning.costs import CostModel
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.pipedream_costs import (
    pipedream_allreduce_time,
    pipedream_dp_time,
    pipedream_stage_time,
    pipedream_states,
    pipedream_transfer_time,
)
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.topology import Level, Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.profiling.load import load_graph
from tests.planning.test_planner import _compositions, _graphs, _partitions

_CLUSTERS = {
    "A": Topology.parse("4x4", ["10GB/s", "1.25GB/s"], None),
    "B": Topology.parse("2x8", ["50GB/s", "3.125GB/s"], None),
    "C": Topology.parse("4", ["5GB/s"], None),
}
# PipeDream's optimizer's own output: config, pipeline ms, data-parallel ms.
_ROWS = [
    ("vgg16", "A", "12-1-1-1-1", 67.13, 135.42),
    ("alexnet", "A", "8-1-1-1-1-4", 15.10, 46.58),
    ("resnet18", "A", "12-4", 23.49, 24.12),
    ("gnmt", "A", "1-1-1-1-1-1-1-1-1-3-3-1", 11.08, 136.38),
    ("vgg16", "B", "8-7-1", 65.77, 66.59),
    ("alexnet", "B", "8-6-1-1", 9.62, 16.18),
    ("resnet18", "B", "14-2", 18.31, 18.31),
    ("gnmt", "B", "1-1-1-1-4-7-1", 8.54, 39.98),
    ("vgg16", "C", "3-1", 170.80, 251.15),
    ("alexnet", "C", "2-1-1", 22.19, 57.99),
    ("gnmt", "C", "1-1-1-1", 25.87, 138.61),
]


@pytest.mark.parametrize(("model", "cluster", "config", "pipe_ms", "dp_ms"), _ROWS)
def test_reproduces_pipedream_rows(
    model: str, cluster: str, config: str, pipe_ms: float, dp_ms: float
) -> None:
    plan = plan_pipeline(load_graph(f"pipedream:{model}"), _CLUSTERS[cluster],
                         PlanOptions(cost_model=CostModel.PIPEDREAM))
    got = "-".join(str(s.replicas) for s in plan.stages)
    assert got == config or abs(plan.time_per_minibatch_s * 1e3 - pipe_ms) < 0.005
    assert plan.time_per_minibatch_s * 1e3 == pytest.approx(pipe_ms, rel=0.01)
    assert plan.baselines_s["dp"] * 1e3 == pytest.approx(dp_ms, rel=0.01)
    assert plan.workers_used == _CLUSTERS[cluster].num_workers


def test_terms_match_their_closed_forms() -> None:
    w, b = 3e8, 1e9
    assert float(pipedream_allreduce_time(w, 1, b)) == 0.0
    assert float(pipedream_allreduce_time(w, 4, b)) == pytest.approx(4 * 3 / 4 * w / b)
    assert float(pipedream_allreduce_time(w, 4, b, 8)) == pytest.approx(4 * 3 / 4 * w / b / 8)
    assert float(pipedream_stage_time(0.2, w, 4, b)) == pytest.approx((0.2 + 0.9) / 4)
    assert float(pipedream_transfer_time(5e7, 2, b)) == pytest.approx(2 * 5e7 / (b * 2))
    expect = ((1.0 + 3 * w / 1e10) / 4 + 3 * w / 1e9 / 4) / 4
    assert pipedream_dp_time(1.0, w, [(4, 1e10), (4, 1e9)]) == pytest.approx(expect)


def test_input_is_zeroed_and_chain_states_are_layers() -> None:
    graph = load_graph("pipedream:vgg16")
    states = pipedream_states(graph)
    assert states.costs.n == len(graph.layers) - 1
    total = sum(x.compute_ms for x in graph.layers if not x.description.startswith("Input"))
    assert states.costs.compute_s[0, -1] * 1e3 == pytest.approx(total)


def test_memory_is_refused_under_pipedream() -> None:
    with pytest.raises(ConfigError, match="drop --memory"):  # an option's error
        plan_pipeline(load_graph("pipedream:vgg16"), _CLUSTERS["C"],
                      PlanOptions(memory_bytes=10**9, cost_model=CostModel.PIPEDREAM))


def _brute(graph: LayerGraph, levels: Sequence[Level]) -> float:
    """Every partition and replica split, PipeDream's terms, every worker used (chains)."""
    t = [x.compute_ms / 1e3 for x in graph.layers]
    w = [float(x.parameter_bytes) for x in graph.layers]
    out = [float(x.activation_bytes) for x in graph.layers]
    n = len(t)

    def best(k: int, i: int, j: int) -> float:
        bw, m = levels[k].bandwidth, levels[k].count
        below = levels[k - 1].count if k else 1
        result = math.inf
        for part in _partitions(i, j):
            for reps in _compositions(m, len(part)):
                worst = 0.0
                for s, ((a, b), r) in enumerate(zip(part, reps, strict=True)):
                    inner = sum(t[a:b + 1]) if k == 0 else best(k - 1, a, b)
                    ar = 4 * (r - 1) * sum(w[a:b + 1]) / (bw * r) / (below if s == 0 else 1)
                    worst = max(worst, (inner + ar) / r)
                    if s:
                        worst = max(worst, 2 * out[a - 1] / (bw * r))
                        if b < n - 1:
                            worst = max(worst, 2 * out[b] / (bw * r))
                result = min(result, worst)
        return result

    return best(len(levels) - 1, 0, n - 1)


_BW = st.sampled_from([1e8, 1e9, 1e10])


@settings(max_examples=150, deadline=None)
@given(_graphs(max_layers=5), st.integers(1, 4), _BW)
def test_one_level_equals_brute_force(graph: LayerGraph, m: int, bw: float) -> None:
    chain = LayerGraph.chain(graph.layers)
    topo = Topology((Level(m, bw),))
    plan = plan_pipeline(chain, topo, PlanOptions(cost_model=CostModel.PIPEDREAM))
    assert plan.time_per_minibatch_s == pytest.approx(_brute(chain, topo.levels), rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(_graphs(max_layers=4), st.integers(1, 3), st.integers(1, 3), _BW, _BW)
def test_two_levels_equal_brute_force(
    graph: LayerGraph, inner: int, outer: int, bw_in: float, bw_out: float
) -> None:
    chain = LayerGraph.chain(graph.layers)
    topo = Topology((Level(inner, bw_in), Level(outer, bw_out)))
    plan = plan_pipeline(chain, topo, PlanOptions(cost_model=CostModel.PIPEDREAM))
    assert plan.time_per_minibatch_s == pytest.approx(_brute(chain, topo.levels), rel=1e-9)

"""The planner's tensor-split fallback: a model no layer plan fits runs split over workers."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from dreampipe.cli import main
from dreampipe.cli.plan_command import check_minibatches, confirm_by_simulation
from dreampipe.errors import PlanError
from dreampipe.planning.operator_search import Link, search_splits
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.plan import Plan, Stage
from dreampipe.planning.planner import memory_needs, plan_pipeline
from dreampipe.planning.splits import Split
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.simulation.simulator import costs_from_profile

_MB = 10**6
_LIMIT = 700 * _MB  # below the whole model (1.05 GB), above a split of it over 2 workers


def _linear(name: str, weights: float, out: float, ms: float) -> Layer:
    return Layer(name, ms / 3, 2 * ms / 3, int(out), int(weights), "Linear(1024, 1024)")


def _relu(name: str, out: float) -> Layer:
    return Layer(name, 0.05, 0.1, int(out), 0, "ReLU()")


def _big_mlp() -> LayerGraph:
    """An mlp whose middle Linear holds 512 MB of weights: no layer cut makes it smaller."""
    return LayerGraph.chain([
        _linear("fc1", 8 * _MB, _MB, 2.0), _relu("r1", _MB),
        _linear("huge", 512 * _MB, _MB, 30.0), _relu("r2", _MB),
        _linear("head", 4 * _MB, _MB / 10, 1.0),
    ], batch_size=32, model="bigmlp")


@pytest.mark.parametrize("workers", [2, 4])
def test_a_model_no_layer_plan_fits_is_split_over_the_servers_workers(workers: int) -> None:
    graph, topo = _big_mlp(), Topology.parse(str(workers))
    needs = memory_needs(graph, topo)
    assert needs["dp"] > _LIMIT and needs["pipeline"] > _LIMIT
    plan = plan_pipeline(graph, topo, PlanOptions(memory_bytes=_LIMIT))
    (stage,) = plan.stages
    assert (plan.tensor_parallel, plan.config, plan.workers_used) == (
        workers, f"1t{workers}", workers)
    assert (stage.first, stage.last, stage.replicas, stage.ranks) == (0, 4, 1, (0,))
    assert stage.memory_bytes <= _LIMIT
    inner = topo.levels[0]  # the split's collectives run on the links inside a server
    search = search_splits(graph, workers, Link(inner.bandwidth, inner.latency), _LIMIT)
    assert stage.splits == search.splits
    assert plan.time_per_minibatch_s == stage.compute_s == search.time_s
    # every layer is split (out or in), so its forward is divided by t
    assert set(stage.splits) == {Split.OUT, Split.IN}
    forward = sum(x.forward_ms for x in graph.layers) / 1e3 / workers
    assert stage.forward_s == pytest.approx(forward)
    assert plan.baselines_s == {}  # neither data parallelism nor a pipeline fits
    again = Plan.from_dict(json.loads(plan.to_json()))
    assert again == plan and again.stages[0].splits == stage.splits


def test_a_split_stays_inside_one_server_and_the_fastest_width_wins() -> None:
    graph = _big_mlp()
    two_servers = plan_pipeline(graph, Topology.parse("2x2"), PlanOptions(memory_bytes=_LIMIT))
    assert two_servers.tensor_parallel == 2  # 4 workers, but 2 per server
    four = plan_pipeline(graph, Topology.parse("4"), PlanOptions(memory_bytes=_LIMIT))
    assert four.time_per_minibatch_s < two_servers.time_per_minibatch_s


def test_without_a_binding_limit_the_plan_is_a_layer_plan_as_before() -> None:
    graph, topo = _big_mlp(), Topology.parse("4")
    for limit in (None, 4000 * _MB):
        plan = plan_pipeline(graph, topo, PlanOptions(memory_bytes=limit))
        assert plan.tensor_parallel == 1 and all(not st.splits for st in plan.stages)
        assert plan == plan_pipeline(graph, topo, PlanOptions(memory_bytes=limit,
                                                              tensor_split=False))


def test_the_split_plan_logs_what_does_not_fit(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dreampipe.planning.planner"):
        plan_pipeline(_big_mlp(), Topology.parse("4"), PlanOptions(memory_bytes=_LIMIT))
    assert ("data parallelism needs 1.1 GB per worker and the smallest layer pipeline about "
            "1.1 GB, more than 700.0 MB: splitting every layer over 4 workers") in caplog.text


def test_too_little_memory_names_all_three_sizes() -> None:
    graph, topo = _big_mlp(), Topology.parse("4")
    with pytest.raises(PlanError) as info:
        plan_pipeline(graph, topo, PlanOptions(memory_bytes=100 * _MB))
    text = str(info.value)
    assert re.search(r"no plan fits in 100\.0 MB .* the smallest needs about 1\.1 GB as a "
                     r"layer pipeline, data parallelism needs 1\.1 GB per worker", text)
    found = re.search(r"smallest tensor split \(over 4 workers\) needs about ([\d.]+) MB", text)
    assert found is not None and float(found[1]) == pytest.approx(263.9, rel=0.01)
    assert "raise --memory" in text
    with pytest.raises(PlanError, match=r"2, 4, 8\.\.\. workers inside one server"):
        plan_pipeline(graph, Topology.parse("2x2"), PlanOptions(memory_bytes=_LIMIT,
                                                                allow_fewer_workers=False))
    dag = LayerGraph(graph.layers, ((0, 1), (1, 2), (0, 2), (2, 3), (3, 4)), model="dag")
    with pytest.raises(PlanError, match="a tensor split needs a chain of layers"):
        plan_pipeline(dag, topo, PlanOptions(memory_bytes=_LIMIT))


def test_a_split_plan_simulates_at_its_predicted_rate() -> None:
    graph, topo = _big_mlp(), Topology.parse("4")
    plan = plan_pipeline(graph, topo, PlanOptions(memory_bytes=_LIMIT))
    stage = plan.stages[0]
    costs = costs_from_profile(graph, plan, topo)
    assert costs.forward_s == (stage.forward_s,)
    assert costs.forward_s[0] + costs.backward_s[0] == pytest.approx(stage.compute_s)
    assert costs.parameter_bytes[0] == pytest.approx(524 * _MB / 4)  # each worker's share
    # the check sizes its schedule in schedule ranks (one per replica), not workers
    assert check_minibatches(plan) == check_minibatches(Plan.from_config(5, [0], [1]))
    sim = confirm_by_simulation(plan, graph, topo)
    assert sim.steady_throughput_minibatches_per_s == pytest.approx(
        plan.throughput_minibatches_per_s, rel=0.01)


def test_split_ranks_sit_at_the_first_worker_of_their_group() -> None:
    graph, topo = _big_mlp(), Topology.parse("2x2", ["10GB/s", "1GB/s"])
    stages = tuple(Stage(first=a, last=b, replicas=1, ranks=(r,), compute_s=0.01,
                         tensor_parallel=2, splits=(Split.BATCH,) * (b - a + 1))
                   for r, (a, b) in enumerate([(0, 1), (2, 4)]))
    plan = Plan(stages=stages, num_layers=5)
    costs = costs_from_profile(graph, plan, topo)
    assert costs.bandwidth_between(0, 1) == topo.bandwidth_between(0, 2) == 1e9


def _cli(capsys: pytest.CaptureFixture[str], tmp_path: Path, *extra: str) -> str:
    profile = tmp_path / "bigmlp.json"
    _big_mlp().save(profile)
    assert main(["plan", str(profile), "-t", "4", "-b", "10GB/s", *extra]) == 0
    return capsys.readouterr().out


def test_the_cli_prints_the_split_and_what_does_not_fit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = _cli(capsys, tmp_path, "--memory", "700MB")
    assert "config 1t4 on 4 of 4 workers" in out
    assert "stage 0 split over 4 workers: layers 0..1 out, 2 in, 3 out, 4 in" in out
    assert "data parallelism: does not fit (needs 1.1 GB per worker)" in out
    assert "layer pipeline: does not fit (the smallest needs 1.1 GB per worker)" in out
    assert "100% of the prediction" in out
    data = json.loads(_cli(capsys, tmp_path, "--memory", "700MB", "--json"))
    assert data["config"] == "1t4" and data["workers_used"] == 4
    assert data["stages"][0]["tensor_parallel"] == 4
    assert data["stages"][0]["splits"] == ["out", "out", "in", "out", "in"]
    assert data["memory_needs_bytes"]["dp"] > 700 * _MB
    plain = _cli(capsys, tmp_path, "--no-mixed-splits")
    assert "does not fit" not in plain and "split over" not in plain
    assert "memory_needs_bytes" not in json.loads(
        _cli(capsys, tmp_path, "--json", "--no-mixed-splits"))
    # a split as a per-stage choice (the default of 'dreampipe plan'): without a memory
    # limit the split is chosen because it is faster than data parallelism's 1 GB
    # all-reduce, and the report says what the stage would hold and take unsplit
    chosen = _cli(capsys, tmp_path)
    assert "config 1t4 on 4 of 4 workers" in chosen
    assert "does not fit" not in chosen
    assert ("unsplit, each of its 4 workers would hold 1.1 GB and its compute alone would "
            "take") in chosen


def test_the_smallest_split_s_figure_is_a_limit_that_fits() -> None:
    """The figure counts what the check adds to the search's bytes (the stage's input,
    sends and working set, large beside the weights here): a limit 1% above it plans a
    split, one 3% below it plans none."""
    graph = LayerGraph.chain([
        _linear("fc1", 8 * _MB, 60 * _MB, 2.0), _relu("r1", 60 * _MB),
        _linear("huge", 512 * _MB, 60 * _MB, 30.0), _relu("r2", 60 * _MB),
        _linear("fc3", 4 * _MB, 60 * _MB, 1.0)], model="wide")
    topo = Topology.parse("4")
    with pytest.raises(PlanError) as info:
        plan_pipeline(graph, topo, PlanOptions(memory_bytes=100 * _MB))
    found = re.search(r"smallest tensor split \(over 4 workers\) needs about ([\d.]+) MB",
                      str(info.value))
    assert found is not None
    figure = float(found[1]) * _MB
    plan = plan_pipeline(graph, topo, PlanOptions(memory_bytes=round(figure * 1.01)))
    assert plan.stages[0].tensor_parallel == 4
    with pytest.raises(PlanError):
        plan_pipeline(graph, topo, PlanOptions(memory_bytes=round(figure * 0.97)))

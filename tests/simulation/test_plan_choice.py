"""A plan chosen for its schedule: a synchronous schedule pays for depth, so the fastest
pair may cut the model less than PipeDream's steady state would."""

from __future__ import annotations

import pytest

from dreampipe.errors import ConfigError
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.topology import Level, Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.simulation.choose import Semantics, choose_schedule
from dreampipe.simulation.plan_choice import choose_plan_and_schedule

__all__: list[str] = []


def _graph(n: int = 8, weights: int = 4 << 10) -> LayerGraph:
    layers = tuple(Layer(f"l{i}", 1.0, 2.0, 4 << 10, weights) for i in range(n))
    return LayerGraph(layers, tuple((i, i + 1) for i in range(n - 1)), 32, "toy")


def _topology(workers: int = 4) -> Topology:
    return Topology((Level(workers, 10e9, 1e-5),))


def _best_rate(graph: LayerGraph, topo: Topology, stages: int, microbatches: int) -> float:
    plan = plan_pipeline(graph, topo, PlanOptions(max_stages=stages))
    choice = choose_schedule(graph, plan, topo, Semantics.SYNC, microbatches=microbatches)
    return max(c.minibatches_per_s for c in choice.candidates)


def test_one_microbatch_keeps_the_plan_whose_synchronous_schedule_is_fastest() -> None:
    graph, topo = _graph(), _topology()
    deep = plan_pipeline(graph, topo)  # the steady state's favourite: cheap links, cut deep
    got = choose_plan_and_schedule(graph, topo, Semantics.SYNC,
                                   lambda k: plan_pipeline(graph, topo,
                                                           PlanOptions(max_stages=k)), 4,
                                   microbatches=1)
    rates = {k: _best_rate(graph, topo, k, 1) for k in range(1, 5)}
    rate = max(c.minibatches_per_s for c in got.schedule.candidates)
    assert rate == pytest.approx(max(rates.values()))
    assert got.plan.num_stages < deep.num_stages  # one microbatch: depth is pure bubble
    assert rate > rates[4] and any("kept" in line for line in got.lines)


def test_nothing_that_fits_is_an_error_naming_the_memory() -> None:
    graph, topo = _graph(weights=1 << 30), _topology()
    with pytest.raises(ConfigError, match="memory"):
        choose_plan_and_schedule(graph, topo, Semantics.SYNC,
                                 lambda k: plan_pipeline(graph, topo, PlanOptions(max_stages=k)), 2,
                                 memory_bytes=1 << 20)

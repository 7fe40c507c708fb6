"""The run's plan: a forced partition priced as given or at its fastest cuts, and a plan
chosen for its schedule (a synchronous schedule pays for depth, so the fastest pair may
cut the model less than PipeDream's steady state would)."""

from __future__ import annotations

from typing import Any

import pytest

from dreampipe.errors import ConfigError, PlanError
from dreampipe.machine.calibration import local_topology
from dreampipe.machine.measure import local_machine
from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.memory_terms import OptimizerTerms
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.plan import Plan
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.topology import Level, Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.runplan.plan_choice import PlanAsk, choose_plan
from dreampipe.runplan.schedule_choice import Semantics, choose_schedule
from runplan.toy_graphs import toy_graph

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
    got = choose_plan(graph, topo, PlanAsk(workers=4, semantics=Semantics.SYNC,
                                           microbatches=1))
    rates = {k: _best_rate(graph, topo, k, 1) for k in range(1, 5)}
    assert got.schedule is not None
    rate = max(c.minibatches_per_s for c in got.schedule.candidates)
    assert rate == pytest.approx(max(rates.values()))
    assert got.plan.num_stages < deep.num_stages  # one microbatch: depth is pure bubble
    assert rate > rates[4] and any("kept" in line for line in got.lines)


def test_nothing_that_fits_is_an_error_naming_the_memory() -> None:
    graph, topo = _graph(weights=1 << 30), _topology()
    with pytest.raises(ConfigError, match="memory"):
        choose_plan(graph, topo, PlanAsk(workers=4, semantics=Semantics.SYNC,
                                         memory_bytes=1 << 20))


def _choose(graph: LayerGraph, workers: int, **ask: Any) -> Plan:
    """The plan for ``workers`` of this machine (the suite's machine file)."""
    topology = local_topology(workers, local_machine(workers))
    return choose_plan(graph, topology, PlanAsk(workers=workers, **ask)).plan


def test_forced_partition_is_evaluated_as_given() -> None:
    graph = toy_graph([4.0, 4.0, 4.0, 4.0])
    plan = _choose(graph, 3, config="2-1", stages="0,3")
    assert [(s.first, s.last, s.replicas) for s in plan.stages] == [(0, 2, 2), (3, 3, 1)]
    straight = _choose(graph, 2, stages="0,2")
    assert straight.config == "straight"
    with pytest.raises(ConfigError, match="needs 3 workers, not 2"):
        _choose(graph, 2, config="2-1", stages="0,3")
    with pytest.raises(ConfigError, match="2 stages but stages="):
        _choose(graph, 3, config="2-1", stages="0,1,2")


def test_config_alone_gets_the_fastest_cuts() -> None:
    # 2-1 on 1+1+1+1+4 ms with small weights: the replicated stage takes the
    # 4 ms of light layers (2 ms per minibatch on 2 replicas), the single one the 4 ms layer
    layers = tuple(Layer(f"l{i}", t / 3, 2 * t / 3, 1024, 1024)
                   for i, t in enumerate([1.0, 1.0, 1.0, 1.0, 4.0]))
    graph = LayerGraph(layers, tuple((i, i + 1) for i in range(4)), 32, "toy")
    plan = _choose(graph, 3, config="2-1")
    assert [(s.first, s.last, s.replicas) for s in plan.stages] == [(0, 3, 2), (4, 4, 1)]
    cuts = [_choose(graph, 3, config="2-1", stages=f"0,{k}") for k in range(1, 5)]
    assert plan.time_per_minibatch_s == min(c.time_per_minibatch_s for c in cuts)
    assert _choose(graph, 5, config="straight").num_stages == 5
    with pytest.raises(ConfigError, match="6 stages but the model has 5 layers"):
        _choose(graph, 6, config="straight")


def test_a_synchronous_choice_under_a_limit_also_weighs_plans_pipedream_would_not_fit() -> None:
    # PipeDream's steady state keeps a version and an input per minibatch in flight, and
    # its kept sends: within 30 MB the planner only splits every layer (1t4). A
    # synchronous schedule holds less; data parallelism on 4 fits, and runs faster.
    layers = tuple(Layer(f"l{i}", 1.0, 2.0, 4 << 20, 4 << 10) for i in range(8))
    graph = LayerGraph(layers, tuple((i, i + 1) for i in range(7)), 32, "toy")
    topo, limit = _topology(), 30 << 20
    limited = plan_pipeline(graph, topo, PlanOptions(memory_bytes=limit, recompute=True))
    assert limited.has_splits
    only_limited = choose_schedule(graph, limited, topo, Semantics.SYNC, limit)
    got = choose_plan(graph, topo, PlanAsk(workers=4, semantics=Semantics.SYNC,
                                           memory_bytes=limit))
    assert got.schedule is not None and not got.plan.has_splits
    kept = next(c for c in got.schedule.candidates if c.kind is got.schedule.kind)
    assert kept.fits and kept.peak_memory_bytes <= limit
    assert kept.minibatches_per_s > max(c.minibatches_per_s
                                        for c in only_limited.candidates if c.fits)
    assert any(line.lstrip().startswith(limited.config) for line in got.lines)


_ADAM = OptimizerTerms(state_copies=2.0)


def test_the_optimizers_state_counts_in_the_plans_memory() -> None:
    # 8 layers of 4 MiB of weights on 3 workers: data parallelism holds 32 MiB and its
    # gradient, which fits 100 MiB; with Adam's two more copies (128 MiB) it does not, and
    # the plan a run with Adam gets fits with them
    graph, topo = _graph(weights=4 << 20), _topology(3)
    costs, limit = RangeCosts.of(graph), 100 << 20
    plain = choose_plan(graph, topo, PlanAsk(workers=3, memory_bytes=limit)).plan
    assert plain.config == "3"
    got = choose_plan(graph, topo, PlanAsk(workers=3, memory_bytes=limit,
                                           optimizer=_ADAM)).plan
    assert got.config != "3"
    held = [costs.memory(s.first, s.last, s.in_flight, optimizer_copies=2) for s in got.stages]
    assert [s.memory_bytes for s in got.stages] == held
    assert max(held) <= limit
    # a forced partition is priced with the state too
    forced = choose_plan(graph, topo, PlanAsk(workers=3, stages="0,3,6", optimizer=_ADAM)).plan
    assert [s.memory_bytes for s in forced.stages] == [
        costs.memory(s.first, s.last, s.in_flight, optimizer_copies=2) for s in forced.stages]
    with pytest.raises(PlanError, match=r"smallest needs about 63\.3 MB as a layer pipeline"):
        choose_plan(graph, topo, PlanAsk(workers=3, memory_bytes=60 << 20, optimizer=_ADAM))

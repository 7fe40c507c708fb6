"""A stage whose first layer writes its input in place runs on a copy of it
(``runtime/input_writes.py``): every prediction of a stage's memory holds that copy per
microbatch in flight (``planning/memory_terms.py``'s ``input_copies``), and no other."""

from __future__ import annotations

import dataclasses

import pytest

from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.evaluate import evaluate_plan
from dreampipe.planning.memory_terms import input_copies
from dreampipe.planning.plan import Plan
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_search import SyncSearch
from dreampipe.planning.sync_stage_option import Recompute
from dreampipe.planning.topology import Level, Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.runtime.memory import TrainingChoices, predict_memory
from dreampipe.runtime.memory_walks import most_in_flight
from dreampipe.runtime.runner_options import OptimizerKind
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout
from dreampipe.simulation.action_costs import costs_from_profile
from dreampipe.simulation.simulator import simulate_schedule

__all__: list[str] = []

#: What crosses the cut before the ReLU: b's output, which the ReLU writes.
_INPUT = 3000
#: Each plan's stage starts; the ReLU (layer 2) begins a stage of the first two only.
_PLANS = [[0, 2], [0, 1, 2], [0, 1], [0, 3], [0, 1, 3]]


def _graph(writes: bool = True) -> LayerGraph:
    """a -> b -> ReLU(inplace=True) -> c, with a residual a -> c; as one process profiles
    it, the ReLU keeps nothing of its own (its output is b's, which b counts)."""
    layers = [Layer("a", 1.0, 2.0, 1000, 400, saved_bytes=1000, backward_bytes=500),
              Layer("b", 1.0, 2.0, _INPUT, 400, saved_bytes=_INPUT, backward_bytes=500),
              Layer("relu", 0.5, 0.5, _INPUT, 0, saved_bytes=0, writes_input=writes),
              Layer("c", 1.0, 2.0, 50, 400, saved_bytes=50, backward_bytes=500)]
    return LayerGraph(tuple(layers), ((0, 1), (1, 2), (2, 3), (0, 3)), 4)


def _copied(plan: Plan, flight: tuple[int, ...] | list[int]) -> list[int]:
    """The copy each stage of ``plan`` holds with ``flight`` microbatches in flight."""
    return [_INPUT * f if st.first == 2 else 0 for st, f in zip(plan.stages, flight,
                                                                  strict=True)]


def _plan(starts: list[int]) -> Plan:
    return Plan.from_config(4, starts, [1] * len(starts))


def test_the_copy_is_the_written_layer_s_own_input_where_it_begins_a_later_stage() -> None:
    """The ReLU's input is b's output (3000 bytes), not the whole cut (a's residual too);
    a first layer's write is of the data the first stage is given, which it never copies."""
    graph = _graph()
    assert graph.cut_bytes()[2] == _INPUT + 1000
    assert input_copies(graph) == [0, 0, _INPUT, 0]
    first = dataclasses.replace(graph, layers=(dataclasses.replace(
        graph.layers[0], writes_input=True), *graph.layers[1:]))
    assert input_copies(first) == [0, 0, _INPUT, 0]
    assert input_copies(_graph(writes=False)) == [0, 0, 0, 0]


@pytest.mark.parametrize("starts", _PLANS)
def test_the_planner_s_stage_memory_holds_the_copy_per_microbatch_in_flight(
        starts: list[int]) -> None:
    """The planner's terms (``dreampipe plan``'s memory column): stashing, one copy per
    microbatch in flight; recomputing, the one microbatch whose graph is made again."""
    plan = _plan(starts)
    spans = [(st.first, st.last) for st in plan.stages]
    flight = list(plan.in_flight)
    costs, plain = RangeCosts.of(_graph()), RangeCosts.of(_graph(writes=False))
    grew = [a - b for a, b in zip(costs.memories(spans, flight), plain.memories(spans, flight),
                                  strict=True)]
    assert grew == _copied(plan, flight)
    again = [True] * len(spans)
    grew = [a - b for a, b in zip(costs.memories(spans, flight, again),
                                  plain.memories(spans, flight, again), strict=True)]
    assert grew == _copied(plan, [1] * len(spans))
    topo = Topology((Level(len(starts), 1e10, 0.0),))
    column = [st.memory_bytes for st in evaluate_plan(_graph(), topo, starts, [1] * len(starts))
              .stages]
    want = [st.memory_bytes for st in evaluate_plan(_graph(writes=False), topo, starts,
                                                    [1] * len(starts)).stages]
    assert [a - b for a, b in zip(column, want, strict=True)] == _copied(plan, flight)


def test_the_planner_fits_the_versions_its_memory_counts_with_the_copy() -> None:
    """The planner's search reads how many versions fit (``max_versions``): as many as the
    stage's memory with the copy counts, fewer than without it."""
    costs, plain = RangeCosts.of(_graph()), RangeCosts.of(_graph(writes=False))
    room = costs.memory(2, 3, 3)  # three versions, three in flight
    assert costs.max_versions(room)[2, 3] == 3
    assert costs.max_versions(room - 1)[2, 3] == 2
    assert plain.max_versions(room - 1)[2, 3] >= 3
    assert costs.max_versions(room)[1, 3] == plain.max_versions(room)[1, 3]


@pytest.mark.parametrize("first", [1, 2])
def test_the_synchronous_planner_s_stage_memory_holds_the_copy(first: int) -> None:
    """Each way a synchronous stage runs: keeping its graphs, a copy per microbatch held;
    recomputing, one."""
    topo = Topology((Level(1, 1e10, 0.0),))
    opts = SyncOptions(global_batch=4, microbatch_size=4, recompute=True)
    tables = SyncSearch(_graph(), topo, opts).tables(1, 1, 4, False)
    plain = SyncSearch(_graph(writes=False), topo, opts).tables(1, 1, 4, False)
    seen = set()
    for x, o in enumerate(tables.options):
        held = 3
        grew = tables.memory_at(x, held, first, 3) - plain.memory_at(x, held, first, 3)
        want = 0 if first != 2 else _INPUT * (held if o.recompute is Recompute.NONE else 1)
        assert grew == pytest.approx(want), o
        seen.add(o.recompute)
    assert {Recompute.NONE, Recompute.STAGE} <= seen


@pytest.mark.parametrize("starts", _PLANS)
def test_the_simulator_s_peak_holds_the_copy_per_microbatch_in_flight(
        starts: list[int]) -> None:
    plan = _plan(starts)
    topo = Topology((Level(len(starts), 1e10, 0.0),))
    schedule = build_schedule([1] * len(starts), ScheduleKind.PIPEDREAM, 12)
    got = simulate_schedule(schedule, costs_from_profile(_graph(), plan, topo))
    want = simulate_schedule(schedule, costs_from_profile(_graph(writes=False), plan, topo))
    assert got.peak_in_flight == want.peak_in_flight
    assert [a - b for a, b in zip(got.peak_memory_bytes, want.peak_memory_bytes,
                                  strict=True)] == _copied(plan, list(got.peak_in_flight))


@pytest.mark.parametrize("kind", [ScheduleKind.PIPEDREAM, ScheduleKind.FLUSH, ScheduleKind.ZB_H1])
@pytest.mark.parametrize("starts", _PLANS)
def test_the_runtime_s_prediction_holds_the_copy_per_microbatch_in_flight(
        starts: list[int], kind: ScheduleKind) -> None:
    """What ``Pipeline`` predicts for each stage's rank (``runtime/memory.py``)."""
    plan = _plan(starts)
    micro = 1 if kind is ScheduleKind.PIPEDREAM else 4
    schedule = MicrobatchLayout(kind=kind, microbatches=micro).build(
        [1] * len(starts), len(starts), plan.in_flight)
    choices = TrainingChoices(optimizer=OptimizerKind.SGD, momentum=0.0, stash=True,
                              vertical_sync=False, compensate=False)
    got = predict_memory(_graph(), plan, schedule, choices)
    want = predict_memory(_graph(writes=False), plan, schedule, choices)
    assert [a - b for a, b in zip(got, want, strict=True)] == _copied(
        plan, most_in_flight(schedule, len(starts)))

"""One copy of a synchronous plan simulated from its own stage terms: it equals the
runtime plan's simulation where both exist, and the objective's closed form bounds it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.planning.layout import Layout
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_objective import PipelineKind
from dreampipe.planning.sync_search import plan_sync
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.simulation.action_costs import costs_from_profile
from dreampipe.simulation.simulator import simulate_schedule
from dreampipe.simulation.sync_copy import simulate_copy


def _chain(times: list[float]) -> LayerGraph:
    layers = [Layer(f"l{i}", t, 2 * t, 0, 0, f"Linear({i})") for i, t in enumerate(times)]
    return LayerGraph.chain(layers, batch_size=1, model="chain")


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([(2, 2), (2, 3), (4, 2)]), st.sampled_from([1, 2, 4]),
       st.data())
def test_a_copy_times_the_runtime_plans_schedule_and_the_objective_bounds_it(
        pv: tuple[int, int], rounds: int, data: st.DataObject) -> None:
    """Free links: the copy's simulation is the runtime plan's, action for action; the
    closed form charges every chunk as the largest, so it is never below."""
    p, v = pv
    times = data.draw(st.lists(st.sampled_from([1.0, 2.0, 3.0, 8.0]), min_size=p * v,
                               max_size=p * v))
    graph, m = _chain(times), p * rounds
    topo = Topology.parse(str(p), ["1e30B/s"], None, ["0us"])
    found = plan_sync(graph, topo, SyncOptions(
        global_batch=m, microbatch_size=1, kinds=(PipelineKind.INTERLEAVED,),
        layout=Layout(1, p, v)))
    plan = found.plan()
    assert plan is not None
    schedule = build_schedule([1] * p * v, ScheduleKind.INTERLEAVED, m, m, virtual_stages=v)
    runtime = simulate_schedule(schedule, costs_from_profile(graph, plan, topo),
                                record_events=False).makespan_s
    copy = simulate_copy(found)
    assert copy == pytest.approx(runtime, rel=1e-9)
    assert copy <= found.time_per_update_s * (1 + 1e-9)
    if len(set(times)) == 1:  # equal chunks: the closed form is the schedule's time
        assert copy == pytest.approx(found.time_per_update_s, rel=1e-9)


def test_a_heavy_chunk_costs_its_worker_once_in_v() -> None:
    """One chunk three times the others: the closed form charges every chunk so; the
    simulated copy charges its worker once and lands well below."""
    graph = _chain([9.0] + [3.0] * 7)
    topo = Topology.parse("4", ["1e30B/s"], None, ["0us"])
    found = plan_sync(graph, topo, SyncOptions(
        global_batch=8, microbatch_size=1, kinds=(PipelineKind.INTERLEAVED,),
        layout=Layout(1, 4, 2)))
    assert simulate_copy(found) < 0.75 * found.time_per_update_s

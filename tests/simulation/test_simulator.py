"""The simulator against closed forms, plus costs from a profile."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from machine.fixtures import DEV_MACHINE

from dreampipe.errors import ScheduleError
from dreampipe.planning.in_flight import in_flight_counts
from dreampipe.planning.plan import Plan
from dreampipe.planning.planner import evaluate_plan
from dreampipe.planning.sync import Sync, SyncKind
from dreampipe.planning.topology import Level, Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.scheduling.actions import ActionKind, ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.validator import validate_schedule
from dreampipe.simulation.action_costs import PlacedTopology
from dreampipe.simulation.simulator import (
    SimCosts,
    costs_from_plan,
    costs_from_profile,
    simulate_schedule,
)

S = ScheduleKind
K = ActionKind


def _equal(p: int, f: float = 1.0, b: float = 2.0, **kw: Any) -> SimCosts:
    return SimCosts(forward_s=(f,) * p, backward_s=(b,) * p, **kw)


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
@pytest.mark.parametrize("kind", [S.GPIPE, S.FLUSH])
def test_sync_bubble_is_p_minus_1_over_m_plus_p_minus_1(p: int, m: int, kind: ScheduleKind) -> None:
    result = simulate_schedule(build_schedule([1] * p, kind, 3 * m, m), _equal(p, 1.0, 2.5))
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.makespan_s == pytest.approx(3 * (m + p - 1) * 3.5)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 2), (6, 16)])
def test_flush_keeps_at_most_p_microbatches_at_stage_0(p: int, m: int) -> None:
    flush = simulate_schedule(build_schedule([1] * p, S.FLUSH, 2 * m, m), _equal(p))
    gpipe = simulate_schedule(build_schedule([1] * p, S.GPIPE, 2 * m, m), _equal(p))
    assert flush.peak_in_flight[0] == min(p, m)
    assert gpipe.peak_in_flight[0] == m
    assert flush.peak_versions == (1,) * p


def test_pipedream_bubble_tends_to_zero_on_balanced_stages() -> None:
    bubbles = [simulate_schedule(build_schedule([1] * 4, S.PIPEDREAM, n), _equal(4),
                        record_events=False).bubble_fraction for n in (4, 16, 64, 256)]
    assert bubbles == sorted(bubbles, reverse=True)
    assert bubbles[-1] < 0.015 < bubbles[0]
    steady = simulate_schedule(
        build_schedule([1] * 4, S.PIPEDREAM, 400), _equal(4), record_events=False
    )
    assert steady.throughput_minibatches_per_s == pytest.approx(1 / 3.0, rel=0.02)


@pytest.mark.parametrize("n", [2, 4, 6])
def test_straight_async_stage_s_holds_n_minus_s_versions(n: int) -> None:
    w, a = 1000.0, 10.0
    result = simulate_schedule(build_schedule([1] * n, S.PIPEDREAM, 5 * n),
                      _equal(n, parameter_bytes=(w,) * n, stash_bytes=(a,) * n))
    assert result.peak_versions == tuple(n - s for s in range(n))
    assert result.peak_in_flight == tuple(n - s for s in range(n))
    assert result.peak_memory_bytes == tuple(
        int((n - s + 1) * w + (n - s) * a) for s in range(n))


@pytest.mark.parametrize(
    "replicas", [(1,) * p for p in range(1, 9)] + [(3, 1), (2, 1, 1), (15, 1)]
)
def test_every_schedule_of_every_small_config_simulates(replicas: tuple[int, ...]) -> None:
    n, workers = len(replicas), sum(replicas)
    straight = all(r == 1 for r in replicas)
    uneven = SimCosts(forward_s=tuple(0.1 * (s + 1) for s in range(n)), backward_s=(0.2,) * n,
                      activation_bytes=(1e3,) * (n - 1), bandwidth=1e6, allreduce_s=(0.05,) * n)
    costs = _equal(n, 1.0, 2.5) if straight else uneven
    one_pass = sum(costs.forward_s) + sum(costs.backward_s)
    for m in range(1, 17):
        for kind in (S.FLUSH, S.GPIPE, S.NAIVE):
            schedule = build_schedule(replicas, kind, m, m)
            result = simulate_schedule(schedule, costs, record_events=False)
            validate_schedule(schedule)
            assert sum(result.busy_s) == pytest.approx(
                m * sum(f + b for f, b in zip(costs.forward_s, costs.backward_s, strict=True)))
            assert result.makespan_s >= one_pass - 1e-9
            if straight and kind is S.NAIVE:
                assert result.makespan_s == pytest.approx(m * one_pass)
            elif straight:
                assert result.bubble_fraction == pytest.approx((n - 1) / (m + n - 1))
            else:
                assert 0 < result.bubble_fraction < 1
        lcm = math.lcm(*replicas)
        result = simulate_schedule(build_schedule(replicas, S.PIPEDREAM, lcm * m), costs,
                                   record_events=False)
        assert result.peak_in_flight == tuple(
            min(in_flight_counts(replicas)[s], lcm * m // r)
            for s, r in enumerate(replicas) for _ in range(r))
        assert result.makespan_s >= max(max(result.busy_s), one_pass - 1e-9)
        dp = simulate_schedule(build_schedule((workers,), S.DP, workers * m, workers),
                               SimCosts(forward_s=(0.3,), backward_s=(0.6,), allreduce_s=(0.1,)),
                               record_events=False)
        assert dp.makespan_s == pytest.approx(m * 0.9)


def test_one_transfer_each_way_adds_bytes_over_bandwidth() -> None:
    costs = SimCosts(forward_s=(1.0, 2.0), backward_s=(3.0, 4.0), activation_bytes=(500.0,),
                     gradient_bytes=(250.0,), bandwidth=100.0)
    result = simulate_schedule(build_schedule([1, 1], S.NAIVE, 1, 1), costs)
    assert result.makespan_s == pytest.approx(1 + 5 + 2 + 4 + 2.5 + 3)
    sends = [e for e in result.events if e.kind is K.SEND_F]
    assert [(e.rank, e.start_s, e.end_s) for e in sends] == [(0, 1.0, 6.0)]
    recvs = [e for e in result.events if e.kind is K.RECV_B]
    assert [(e.rank, e.start_s, e.end_s) for e in recvs] == [(0, 12.0, 14.5)]


def test_link_carries_one_transfer_at_a_time_and_sender_computes_on() -> None:
    costs = SimCosts(forward_s=(0.5, 0.0), backward_s=(0.0, 0.0), activation_bytes=(100.0,),
                     bandwidth=100.0)
    result = simulate_schedule(build_schedule([1, 1], S.GPIPE, 4, 4), costs)
    arrivals = sorted(e.end_s for e in result.events if e.kind is K.SEND_F)
    assert arrivals == pytest.approx([1.5, 2.5, 3.5, 4.5])
    forwards = sorted(e.end_s for e in result.events if e.kind is K.FORWARD and e.rank == 0)
    assert forwards == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_topology_bandwidth_between_ranks() -> None:
    topo = Topology((Level(2, 1000.0), Level(2, 10.0)))
    costs = SimCosts(forward_s=(0.0,) * 4, backward_s=(0.0,) * 4, activation_bytes=(100.0,) * 3,
                     bandwidth=topo)
    result = simulate_schedule(build_schedule([1] * 4, S.NAIVE, 1, 1), costs)
    hops = {e.rank: e.duration_s for e in result.events if e.kind is K.SEND_F}
    assert hops == pytest.approx({0: 0.1, 1: 10.0, 2: 0.1})


def test_replicas_of_one_server_share_its_link_to_another() -> None:
    # 2x2: two replicas on server 0 send to two on server 1; each transfer takes 1 s on
    # the level's link. Across servers they share server 0's link out (one at a time);
    # on one level of four workers each pair has its own link (side by side)
    costs = dict(forward_s=(0.0, 0.0), backward_s=(0.0, 0.0), activation_bytes=(10.0,))
    schedule = build_schedule([2, 2], S.GPIPE, 2, 2)
    shared = simulate_schedule(schedule, SimCosts(**costs, bandwidth=Topology(
        (Level(2, 1e9), Level(2, 10.0)))))
    sends = sorted(x for e in shared.events if e.kind is K.SEND_F for x in (e.start_s, e.end_s))
    assert sends == pytest.approx([0.0, 1.0, 1.0, 2.0])
    apart = simulate_schedule(schedule, SimCosts(**costs, bandwidth=Topology((Level(4, 10.0),))))
    sends = sorted(x for e in apart.events if e.kind is K.SEND_F for x in (e.start_s, e.end_s))
    assert sends == pytest.approx([0.0, 0.0, 1.0, 1.0])


def test_a_shared_link_serves_transfers_in_the_order_they_are_posted() -> None:
    # 2x2, stages on workers 0, 2, 1, 3: the forwards of stages 0 (1 s each, one every
    # 2 s) and 2 (1.5 s each) both leave server 0. Stage 2 posts its first at 3 s, before
    # stage 0 posts its second at 4 s, so it goes first; stage 0's second waits for it
    topo = Topology((Level(2, 1e9), Level(2, 10.0)))
    costs = SimCosts(forward_s=(2.0, 0.0, 0.0, 0.0), backward_s=(0.0,) * 4,
                     activation_bytes=(10.0, 0.0, 15.0),
                     bandwidth=PlacedTopology(topo, (0, 2, 1, 3)))
    result = simulate_schedule(build_schedule([1] * 4, S.GPIPE, 4, 4), costs)
    sends = {r: [x for e in sorted(result.events, key=lambda e: e.start_s)
                 if e.kind is K.SEND_F and e.rank == r for x in (e.start_s, e.end_s)]
             for r in (0, 2)}
    assert sends[2][:2] == pytest.approx([3.0, 4.5])
    assert sends[0][:4] == pytest.approx([2.0, 3.0, 4.5, 5.5])
    for link in (sends[0], sends[2]):
        assert all(b >= a for a, b in itertools.pairwise(link))
    merged = sorted(zip(sends[0][::2] + sends[2][::2], sends[0][1::2] + sends[2][1::2],
                        strict=True))
    for (_, end), (start, _) in itertools.pairwise(merged):
        assert start >= end - 1e-12  # one at a time on server 0's link out


def test_without_a_shared_link_the_order_of_stepping_changes_nothing() -> None:
    topo = Topology((Level(2, 1e9), Level(2, 10.0)))
    costs = SimCosts(forward_s=(2.0, 0.5, 1.0, 0.2), backward_s=(1.0, 3.0, 0.5, 0.4),
                     activation_bytes=(10.0, 5.0, 15.0), bandwidth=topo)
    assert costs.shares_links(4) and not costs.shares_links(2)
    assert replace(costs, bandwidth=PlacedTopology(topo, (0, 2))).shares_links(2)
    assert not replace(costs, bandwidth=100.0).shares_links(4)
    assert not replace(costs, bandwidth=Topology((Level(4, 10.0),))).shares_links(4)
    # on one level each pair's link is its own: stepping in time order books the same spans
    flat = replace(costs, bandwidth=Topology((Level(4, 10.0),)))
    schedule = build_schedule([1, 2, 1, 1], S.PIPEDREAM, 12)
    free = simulate_schedule(schedule, flat)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SimCosts, "shares_links", lambda self, ranks: True)
        ordered = simulate_schedule(schedule, flat)
    def key(e: Any) -> tuple[Any, ...]:
        return (e.rank, e.start_s, e.kind.value, e.microbatch)

    assert sorted(free.events, key=key) == sorted(ordered.events, key=key)
    assert free.makespan_s == ordered.makespan_s


def test_allreduce_overlaps_the_backward_it_follows() -> None:
    dp = build_schedule((2,), S.DP, 2, 2)
    slow = simulate_schedule(dp, SimCosts(forward_s=(1.0,), backward_s=(2.0,), allreduce_s=(5.0,)))
    assert slow.makespan_s == pytest.approx(1 + 5)
    fast = simulate_schedule(dp, SimCosts(forward_s=(1.0,), backward_s=(2.0,), allreduce_s=(0.5,)))
    assert fast.makespan_s == pytest.approx(3.0)
    reduces = [e for e in slow.events if e.kind is K.ALLREDUCE]
    assert [(e.start_s, e.end_s) for e in reduces] == [(1.0, 6.0), (1.0, 6.0)]


def test_allreduce_starts_its_delay_into_the_backward() -> None:
    dp = build_schedule((2,), S.DP, 2, 2)
    costs = SimCosts(forward_s=(1.0,), backward_s=(2.0,), allreduce_s=(5.0,),
                     allreduce_delay_s=(1.5,))
    reduces = [e for e in simulate_schedule(dp, costs).events if e.kind is K.ALLREDUCE]
    assert [(e.start_s, e.end_s) for e in reduces] == [(2.5, 7.5), (2.5, 7.5)]


def test_busy_idle_and_throughput_definitions() -> None:
    result = simulate_schedule(build_schedule([1, 1], S.GPIPE, 4, 2),
                      SimCosts(forward_s=(1.0, 1.0), backward_s=(1.0, 1.0), step_s=(0.5, 0.5),
                               microbatch_fraction=0.5))
    assert result.busy_s == (4 * 2.0 + 2 * 0.5,) * 2
    assert sum(result.busy_s) + sum(result.idle_s) == pytest.approx(2 * result.makespan_s)
    assert result.throughput_minibatches_per_s == pytest.approx(2 / result.makespan_s)
    assert result.summary()["schedule"] == "gpipe"
    compute = sorted((e.start_s, e.end_s) for e in result.events
                     if e.rank == 0 and e.kind in (K.FORWARD, K.BACKWARD, K.STEP))
    assert all(a[1] <= b[0] + 1e-12 for a, b in itertools.pairwise(compute))


def test_costs_must_match_the_schedule() -> None:
    with pytest.raises(ScheduleError, match="3 stages"):
        simulate_schedule(build_schedule([1, 1], S.GPIPE, 2, 2), _equal(3))
    with pytest.raises(ScheduleError, match="allreduce_s has 1 entries; give 2"):
        SimCosts(forward_s=(1.0, 1.0), backward_s=(1.0, 1.0), allreduce_s=(1.0,))
    with pytest.raises(ScheduleError, match="forward_s and backward_s"):
        SimCosts(forward_s=(1.0,), backward_s=())


def _graph() -> LayerGraph:
    layers = [Layer(f"l{i}", 10.0 * (i + 1), 20.0 * (i + 1), 1000 * (i + 1), 4000 * i)
              for i in range(4)]
    return LayerGraph.chain(layers, batch_size=8)


def test_costs_from_profile_sums_layers_and_scales_with_microbatch_fraction() -> None:
    topo = Topology((Level(2, 1e6), Level(2, 1e3)))
    plan = Plan.from_config(4, [0, 2], [1, 3])
    costs = costs_from_profile(_graph(), plan, topo, microbatch_fraction=0.5)
    assert costs.forward_s == pytest.approx((0.015, 0.035))
    assert costs.backward_s == pytest.approx((0.03, 0.07))
    assert costs.activation_bytes == pytest.approx((1000.0,))
    assert costs.parameter_bytes == (4000.0, 20000.0)
    assert costs.stash_bytes == pytest.approx((1500.0, 3500.0 + 1000.0))  # stage 1: + its input
    # workers 1 | 2, 3: a hierarchical ring, 2 in server 1 then 2 servers (the default)
    inside, across = 2 * 1 / 2 * 20000 / 1e6, 2 * 1 / 2 * 20000 / 1e3
    assert costs.allreduce_s == pytest.approx((0.0, inside + across))
    ring = costs_from_profile(_graph(), plan, topo, 0.5, Sync(SyncKind.RING))
    assert ring.allreduce_s == pytest.approx((0.0, 2 * 2 / 3 * 20000 / 1e3))
    assert costs.bandwidth_between(0, 1) == 1e6


def test_local_costs_add_the_runtime_forward_host_time_per_microbatch() -> None:
    from dreampipe.machine import calibration as machine

    m = replace(DEV_MACHINE, cores=4, corun_slowdown=1.0)  # a quiet core each

    for bounds in ([0], [0, 2], [0, 1, 3]):
        plan = Plan.from_config(4, bounds, [1] * len(bounds))
        base = costs_from_profile(_graph(), plan, machine.local_topology(len(bounds), m), 0.5)
        costs = machine.local_costs(_graph(), plan, microbatch_fraction=0.5, machine=m)
        extra = [m.stage_forward_s] * len(bounds)
        extra[0] += m.batch_load_s
        if len(bounds) > 1:
            extra[-1] += m.batch_load_s
        extra[-1] += m.loss_s
        assert costs.forward_s == pytest.approx(
            tuple(f + e for f, e in zip(base.forward_s, extra, strict=True))
        )
        assert costs.backward_s == base.backward_s
        assert costs.send_overhead_s == m.send_overhead_s


def test_costs_from_profile_rejects_a_mismatched_profile() -> None:
    with pytest.raises(ScheduleError, match="3 layers but the profile has 4"):
        costs_from_profile(_graph(), Plan.from_config(3, [0], [1]), Topology.parse("4"))
    with pytest.raises(ScheduleError, match="larger --topology"):
        costs_from_profile(_graph(), Plan.from_config(4, [0], [8]), Topology.parse("4"))


def test_costs_from_plan_uses_the_plan_predictions() -> None:
    base = Plan.from_config(4, [0, 2], [1, 1])
    stages = tuple(
        type(st)(first=st.first, last=st.last, replicas=st.replicas, ranks=st.ranks,
                 compute_s=0.3, comm_s=0.2)
        for st in base.stages)
    plan = Plan(stages=stages, num_layers=4)
    costs = costs_from_plan(plan, Topology.parse("2", bandwidths=["100B/s"]))
    assert costs.forward_s == pytest.approx((0.1, 0.1))
    assert costs.backward_s == pytest.approx((0.2, 0.2))
    # a plan that says its stages' forwards splits compute_s at them
    timed = Plan(stages=tuple(replace(st, forward_s=f) for st, f in zip(stages, (0.05, 0.15),
                                                                         strict=True)),
                 num_layers=4)
    costs = costs_from_plan(timed, Topology.parse("2", bandwidths=["100B/s"]))
    assert costs.forward_s == pytest.approx((0.05, 0.15))
    assert costs.backward_s == pytest.approx((0.25, 0.15))
    result = simulate_schedule(build_schedule([1, 1], S.NAIVE, 1, 1), costs)
    assert result.makespan_s == pytest.approx(0.6 + 0.2)
    # stages placed on workers 0 and 2 of 2x2: the cut's bytes and links are those
    # between the two servers, not between ranks 0 and 1 (one server)
    placed = Plan(stages=tuple(replace(st, workers=(w,)) for st, w in zip(stages, (0, 2),
                                                                          strict=True)),
                  num_layers=4)
    costs = costs_from_plan(placed, Topology((Level(2, 1e6), Level(2, 100.0))))
    assert costs.activation_bytes == pytest.approx((10.0,))
    assert costs.links_between(0, 1) == ((1, 0, 0), (1, 1, 1))
    result = simulate_schedule(build_schedule([1, 1], S.NAIVE, 1, 1), costs)
    assert result.makespan_s == pytest.approx(0.6 + 0.2)


def test_send_overhead_occupies_the_sender() -> None:
    sched = build_schedule([1, 1], ScheduleKind.GPIPE, 4, microbatches_per_update=4)
    base = SimCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), activation_bytes=(100.0,))
    slow = replace(base, send_overhead_s=0.5, send_copy_bandwidth=100.0)
    quick, loaded = simulate_schedule(sched, base), simulate_schedule(sched, slow)
    # Stage 0 posts 4 sends in a row, each costing 0.5 s + 100 B / (100 B/s) of its own time.
    assert loaded.makespan_s > quick.makespan_s + 1.5
    with pytest.raises(ScheduleError, match="send_overhead_s"):
        replace(base, send_overhead_s=-1.0)


def test_a_step_copies_the_weights_a_microbatch_in_flight_still_holds() -> None:
    # straight 2-stage PipeDream: stage 0 steps after B(u) with u+1 in flight on the
    # live weights (copy-on-write: the copy), except after the last; stage 1 never
    microbatches = 6
    sched = build_schedule([1, 1], S.PIPEDREAM, microbatches)
    base = SimCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), step_s=(0.25, 0.25),
                    parameter_bytes=(50.0, 50.0))
    copying = replace(base, stash_copy_bandwidth=100.0)
    steps = [[e.end_s - e.start_s for e in simulate_schedule(sched, c).events
              if e.kind is K.STEP and e.stage == 0] for c in (base, copying)]
    assert steps[0] == pytest.approx([0.25] * microbatches)
    assert steps[1] == pytest.approx([0.75] * (microbatches - 1) + [0.25])
    stage1 = [e.end_s - e.start_s for e in simulate_schedule(sched, copying).events
              if e.kind is K.STEP and e.stage == 1]
    assert stage1 == pytest.approx([0.25] * microbatches)
    flush = build_schedule([1, 1], S.FLUSH, 4, microbatches_per_update=4)  # nothing in flight
    assert simulate_schedule(flush, copying).makespan_s == pytest.approx(
        simulate_schedule(flush, base).makespan_s)
    with pytest.raises(ScheduleError, match="stash_copy_bandwidth"):
        replace(base, stash_copy_bandwidth=0.0)


@pytest.mark.parametrize(("replicas", "microbatches"), [((3, 2), 7), ((3, 2), 5), ((5, 7), 36),
                                                        ((5, 7), 3), ((11, 13, 17, 19), 100)])
def test_partial_last_round_simulates(replicas: tuple[int, ...], microbatches: int) -> None:
    n = len(replicas)
    costs = _equal(n, 1.0, 2.0, step_s=(0.25,) * n, allreduce_s=(0.5,) * n,
                   activation_bytes=(10.0,) * (n - 1), bandwidth=100.0)
    sched = build_schedule(replicas, S.PIPEDREAM, microbatches)
    result = simulate_schedule(sched, costs)
    steps = [-(-microbatches // r) for r in replicas]  # every replica steps once per round
    assert sum(result.busy_s) == pytest.approx(
        microbatches * n * 3.0 + 0.25 * sum(r * k for r, k in zip(replicas, steps, strict=True)))
    reduces = Counter((e.stage, e.microbatch) for e in result.events if e.kind is K.ALLREDUCE)
    assert reduces == {(s, k): r for s, r in enumerate(replicas) if r > 1 for k in range(steps[s])}
    spans = {(e.stage, e.microbatch): (e.start_s, e.end_s)
             for e in result.events if e.kind is K.ALLREDUCE}
    for e in result.events:  # the replicas of a round leave it together
        if e.kind is K.ALLREDUCE:
            assert (e.start_s, e.end_s) == spans[(e.stage, e.microbatch)]


def test_steady_throughput_leaves_out_start_up_and_drain() -> None:
    # Straight, balanced: one minibatch per F+B = 3 s once the pipeline is full.
    sched = build_schedule([1] * 4, S.PIPEDREAM, 40)
    result = simulate_schedule(sched, _equal(4), record_events=False)
    assert result.throughput_minibatches_per_s < 0.95 / 3.0
    assert result.steady_throughput_minibatches_per_s == pytest.approx(1 / 3.0)
    assert result.steady_microbatches == 40 - 2 * 4 - 1
    assert result.summary()["steady_microbatches"] == result.steady_microbatches


def test_steady_window_counts_replicas_that_finish_together() -> None:
    # 4 replicas finish each round at the same instant: 4 microbatches per 3 s, exactly.
    # The window runs from the end of round 1 (the 4th finish) to the end of
    # round 8 (the 4th from the last): rounds 2..8 finish in it.
    result = simulate_schedule(build_schedule([4], S.PIPEDREAM, 40), _equal(1),
                               record_events=False)
    assert result.steady_throughput_minibatches_per_s == pytest.approx(4 / 3.0)
    assert result.steady_microbatches == 7 * 4


def test_too_short_a_run_has_no_steady_window() -> None:
    result = simulate_schedule(build_schedule([1] * 4, S.PIPEDREAM, 9), _equal(4))
    assert result.steady_microbatches == 0
    assert result.steady_throughput_minibatches_per_s == result.throughput_minibatches_per_s
    assert result.summary()["steady_throughput_minibatches_per_s"] is None, (
        "JSON must not pass the whole run's rate off as a steady one")


def test_jitter_scales_forwards_and_backwards_by_its_draws() -> None:
    dp = build_schedule((2,), S.DP, 20, 2)
    base = SimCosts(forward_s=(1.0,), backward_s=(2.0,), step_s=(0.5,))
    assert simulate_schedule(dp, replace(base, jitter=(1.0,))).makespan_s == pytest.approx(
        simulate_schedule(dp, base).makespan_s)
    doubled = simulate_schedule(dp, replace(base, jitter=(2.0,)))
    assert doubled.makespan_s == pytest.approx(10 * (2 * 3.0 + 0.5))
    steps = [e.duration_s for e in doubled.events if e.kind is K.STEP]
    assert steps == pytest.approx([0.5] * 20)


def test_jitter_makes_replicas_wait_for_the_slower_and_repeats_exactly() -> None:
    dp = build_schedule((2,), S.DP, 400, 2)
    base = SimCosts(forward_s=(1.0,), backward_s=(2.0,), allreduce_s=(0.1,))
    jittered = replace(base, jitter=(0.5, 1.5))  # mean 1: on its own, no slower
    one = simulate_schedule(dp, jittered)
    assert one.makespan_s == simulate_schedule(dp, jittered).makespan_s
    steady = simulate_schedule(dp, base).makespan_s
    # each round waits for the slower of two replicas: 3 x E[max of two draws] = 3 x 1.25
    assert one.makespan_s > 1.15 * steady
    assert one.makespan_s < 1.35 * steady


def test_jitter_factors_must_be_positive_and_finite() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ScheduleError, match="jitter"):
            SimCosts(forward_s=(1.0,), backward_s=(1.0,), jitter=(1.0, bad))


# ---- the schedules of issue 32: the done-when bounds, computed by the simulator ----
def _chain_costs(stages: int, layers_per_stage: int) -> SimCosts:
    """F = 10 ms and a backward of 20 ms per layer, no split given (B = W = 10 ms)."""
    return SimCosts(forward_s=(0.010 * layers_per_stage,) * stages,
                    backward_s=(0.020 * layers_per_stage,) * stages)


def test_zb_h1_leaves_at_most_half_of_1f1b_flush_bubble() -> None:
    costs = _chain_costs(4, 1)
    flush = simulate_schedule(build_schedule([1] * 4, S.FLUSH, 8, 8), costs)
    zb = simulate_schedule(build_schedule([1] * 4, S.ZB_H1, 8, 8), costs)
    assert flush.bubble_fraction == pytest.approx(3 / 11)
    assert zb.bubble_fraction == pytest.approx(1 / 9)  # (p-1)(F+B-W) over the makespan
    assert zb.bubble_fraction <= 0.5 * flush.bubble_fraction


def test_interleaved_on_8_stages_leaves_at_most_065_of_flush_on_4() -> None:
    flush = simulate_schedule(build_schedule([1] * 4, S.FLUSH, 8, 8), _chain_costs(4, 2))
    inter = simulate_schedule(build_schedule([1] * 8, S.INTERLEAVED, 8, 8, virtual_stages=2),
                              _chain_costs(8, 1))
    assert inter.bubble_fraction == pytest.approx(0.158, abs=5e-4)
    assert inter.bubble_fraction <= 0.65 * flush.bubble_fraction
    assert len(inter.busy_s) == 4


def test_weight_gradient_costs_its_share_and_b_the_rest() -> None:
    costs = SimCosts(forward_s=(1.0,), backward_s=(3.0,), weight_grad_s=(1.0,))
    zb = simulate_schedule(build_schedule([1], S.ZB_H1, 1, 1), costs)
    spans = {e.kind: e.duration_s for e in zb.events if e.kind is not K.STEP}
    assert spans == {K.FORWARD: 1.0, K.BACKWARD: 2.0, K.WEIGHT: 1.0}
    flush = simulate_schedule(build_schedule([1], S.FLUSH, 1, 1), costs)
    assert {e.kind: e.duration_s for e in flush.events if e.kind is K.BACKWARD} == {
        K.BACKWARD: 3.0}
    assert SimCosts(forward_s=(1.0,), backward_s=(3.0,)).weight_grad_s == (1.5,)
    with pytest.raises(ScheduleError, match="weight_grad_s"):
        SimCosts(forward_s=(1.0,), backward_s=(3.0,), weight_grad_s=(4.0,))


def test_zero_bubble_microbatches_stay_in_flight_until_their_w() -> None:
    costs = _chain_costs(4, 1)
    h1 = simulate_schedule(build_schedule([1] * 4, S.ZB_H1, 8, 8), costs)
    h2 = simulate_schedule(build_schedule([1] * 4, S.ZB_H2, 8, 8), costs)
    assert h1.peak_in_flight == (4, 4, 4, 4)
    assert h2.peak_in_flight == (7, 7, 7, 7)
    slow_b = SimCosts(forward_s=(0.01,) * 4, backward_s=(0.02,) * 4, weight_grad_s=(0.005,) * 4)
    assert (simulate_schedule(build_schedule([1] * 4, S.ZB_H2, 8, 8), slow_b).makespan_s
            < simulate_schedule(build_schedule([1] * 4, S.ZB_H1, 8, 8), slow_b).makespan_s)


def test_2bw_holds_two_weight_versions_and_no_flush() -> None:
    costs = _chain_costs(4, 1)
    two = simulate_schedule(build_schedule([1] * 4, S.TWO_BW, 32, 8), costs)
    flush = simulate_schedule(build_schedule([1] * 4, S.FLUSH, 32, 8), costs)
    assert two.peak_versions[:3] == (2, 2, 2)
    assert flush.peak_versions == (1, 1, 1, 1)
    assert two.makespan_s < flush.makespan_s


def test_costs_from_profile_sum_measured_or_half_weight_gradients() -> None:
    graph = LayerGraph.chain([Layer("a", 1.0, 4.0, 8, 8, weight_grad_ms=1.0),
                              Layer("b", 1.0, 2.0, 8, 8), Layer("c", 1.0, 2.0, 8, 8)])
    plan = Plan.from_config(3, [0, 2], [1, 1])
    costs = costs_from_profile(graph, plan, Topology.parse("1x2"))
    assert costs.backward_s == pytest.approx((6e-3, 2e-3))
    assert costs.weight_grad_s == pytest.approx((2e-3, 1e-3))


@pytest.mark.parametrize("replicas", [(1,), (1, 1), (1,) * 4, (1,) * 6, (2, 1), (2, 1, 3)])
def test_new_schedules_of_small_configs_do_all_their_work(replicas: tuple[int, ...]) -> None:
    n = len(replicas)
    costs = SimCosts(forward_s=tuple(0.1 * (s + 1) for s in range(n)), backward_s=(0.2,) * n,
                     weight_grad_s=(0.05,) * n, activation_bytes=(1e3,) * (n - 1),
                     bandwidth=1e6, allreduce_s=(0.05,) * n)
    work = sum(f + b for f, b in zip(costs.forward_s, costs.backward_s, strict=True))
    rounds = math.lcm(*replicas)
    for m in range(1, 13):
        for kind, per in ((S.ZB_H1, m), (S.ZB_H2, m), (S.TWO_BW, rounds * m)):
            schedule = build_schedule(replicas, kind, 3 * per, per)
            result = simulate_schedule(schedule, costs, record_events=False)
            assert sum(result.busy_s) == pytest.approx(3 * per * work)
            assert result.makespan_s >= 3 * per * max(costs.forward_s) + 0.2 - 1e-9
    for workers in (1, 2, 3):
        for v in (1, 2, 3):
            stages = workers * v
            equal = _equal(stages, 1.0, 2.0)
            for m in (workers, 2 * workers, 4 * workers):
                schedule = build_schedule([1] * stages, S.INTERLEAVED, 2 * m, m,
                                          virtual_stages=v)
                result = simulate_schedule(schedule, equal, record_events=False)
                assert len(result.busy_s) == workers
                assert result.busy_s == pytest.approx((2 * m * v * 3.0,) * workers)


def test_a_recomputing_stage_runs_its_forward_twice_and_stashes_its_input() -> None:
    # 1r-1 against 1-1: the first stage's backward runs its forward again, a microbatch in flight
    # keeps its input only, and the recomputed activations are held once
    graph = LayerGraph.chain([Layer("a", 2.0, 4.0, 10**6, 10**3, saved_bytes=10**8),
                              Layer("b", 2.0, 4.0, 10**6, 10**3)])
    topo = Topology((Level(2, 1e10, 0.0),))
    plain = evaluate_plan(graph, topo, [0, 1], [1, 1])
    again = evaluate_plan(graph, topo, [0, 1], [1, 1], recompute=[True, False])
    assert again.config == "1r-1"
    assert again.stages[0].compute_s == pytest.approx(plain.stages[0].compute_s + 2e-3)
    assert again.stages[0].memory_bytes < plain.stages[0].memory_bytes
    c0, c1 = costs_from_profile(graph, plain, topo), costs_from_profile(graph, again, topo)
    assert c1.backward_s[0] == pytest.approx(c0.backward_s[0] + c0.forward_s[0])
    x = graph.cut_bytes()[0]
    assert c1.stash_bytes[0] == pytest.approx(x)  # the input only (the cut before)
    assert c1.recompute_bytes == (c0.stash_bytes[0], 0.0)
    microbatches = 40
    r0 = simulate_schedule(build_schedule([1, 1], S.PIPEDREAM, microbatches), c0)
    r1 = simulate_schedule(build_schedule([1, 1], S.PIPEDREAM, microbatches), c1)
    assert r1.peak_in_flight == r0.peak_in_flight == (2, 1)
    # two microbatches stash their input instead of input and activations; one is recomputed
    assert r0.peak_memory_bytes[0] - r1.peak_memory_bytes[0] == pytest.approx(
        2 * c0.stash_bytes[0] - 2 * x - c0.stash_bytes[0], abs=1)
    assert r1.steady_throughput_minibatches_per_s == pytest.approx(
        again.throughput_minibatches_per_s, rel=0.02)


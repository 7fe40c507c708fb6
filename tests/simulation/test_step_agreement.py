"""``steps_agree``: every rank's first STEP of an update waits for every other rank's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.stepping import Stepper
from dreampipe.simulation.rank_memory import RankMemory
from dreampipe.simulation.simulator import SimCosts, simulate_schedule

__all__: list[str] = []

S = ScheduleKind


def _per_minibatch(kind: S, forward: tuple[float, ...], agree: bool, m: int = 1,
                   updates: int = 40) -> float:
    schedule = build_schedule([1] * len(forward), kind, updates * m, m)
    costs = SimCosts(forward_s=forward, backward_s=tuple(2 * f for f in forward),
                     steps_agree=agree)
    return simulate_schedule(schedule, costs, record_events=False).makespan_s / updates


def test_pipedream_s_last_stage_waits_for_the_first_stage_s_backward() -> None:
    """Two equal stages (forward 1, backward 2): each runs a minibatch in 3 on its own;
    agreeing, the second stage's next forward follows the first stage's backward of the
    minibatch before, so a minibatch takes B0 + F1 + B1 = 5."""
    assert _per_minibatch(S.PIPEDREAM, (1.0, 1.0), False) == pytest.approx(3.0, rel=0.03)
    assert _per_minibatch(S.PIPEDREAM, (1.0, 1.0), True) == pytest.approx(5.0, rel=0.03)
    # a first stage of three quarters of the work sets the pace either way
    alone, agreed = (_per_minibatch(S.PIPEDREAM, (1.5, 0.5), a) for a in (False, True))
    assert alone == pytest.approx(4.5, rel=0.03) and agreed == pytest.approx(alone, rel=0.03)


def test_2bw_pays_less_and_a_flushed_pipeline_nothing() -> None:
    """2bw's two microbatches an update (each of forward 1, backward 2 a stage): 6 an
    update alone, 8 agreeing; a flushed pipeline waits for every backward anyway."""
    assert _per_minibatch(S.TWO_BW, (1.0, 1.0), False, m=2) == pytest.approx(6.0, rel=0.03)
    assert _per_minibatch(S.TWO_BW, (1.0, 1.0), True, m=2) == pytest.approx(8.0, rel=0.03)
    for kind in (S.FLUSH, S.GPIPE):
        assert _per_minibatch(kind, (1.0, 1.0), True, m=4) == \
            _per_minibatch(kind, (1.0, 1.0), False, m=4)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([S.PIPEDREAM, S.TWO_BW, S.FLUSH, S.GPIPE, S.ZB_H1, S.ZB_H2]),
       st.integers(1, 4), st.integers(1, 2), st.integers(1, 4),
       st.lists(st.floats(0.1, 3.0), min_size=4, max_size=4))
def test_agreeing_never_speeds_a_run_and_never_deadlocks(
        kind: S, stages: int, replicas: int, m: int, work: list[float]) -> None:
    """Every schedule, replicated alike on every stage, finishes when its ranks agree, no
    sooner than without; a flushed pipeline whose every backward precedes the update's
    STEPs (1f1b-flush, GPipe) no later either, and neither does one rank. (Zero-bubble
    schedules defer weight gradients past another stage's STEP, so they may wait.)"""
    if kind is S.PIPEDREAM:
        m = 1
    elif kind is S.TWO_BW:
        m = replicas * stages
    schedule = build_schedule([replicas] * stages, kind, 4 * m * replicas, m * replicas
                              if kind is not S.PIPEDREAM else 1)
    stepper = Stepper(schedule, agree_steps=True)
    assert stepper.run() == []
    costs = SimCosts(forward_s=tuple(work[:stages]),
                     backward_s=tuple(2 * w for w in work[:stages]), allreduce_s=(0.3,) * stages)
    alone = simulate_schedule(schedule, costs, record_events=False).makespan_s
    agreed = simulate_schedule(schedule, SimCosts(**{**costs.__dict__, "steps_agree": True}),
                               record_events=False).makespan_s
    assert agreed >= alone - 1e-9
    if kind in (S.FLUSH, S.GPIPE) or stages * replicas == 1:
        assert agreed == pytest.approx(alone)


def test_2bw_overlaps_a_replicated_stage_s_all_reduce_with_the_next_minibatch() -> None:
    """A second stage on 2 replicas, each with 2 microbatches a minibatch of forward 1 and
    backward 2 (6), and an all-reduce of 3: with its step deferred past the next
    minibatch's forwards, 2bw hides the all-reduce behind that work; built as for ranks
    that agree (each step right after its all-reduce) it waits for it, as a flushed
    pipeline does. While in flight, the rank holds the next update's gradients beside
    it, one copy of the weights more than one version of them alone."""
    def run(kind: S, agree: bool) -> tuple[float, int]:
        schedule = build_schedule([1, 2], kind, 40 * 4, 4, steps_agree=agree)
        costs = SimCosts(forward_s=(0.25, 1.0), backward_s=(0.5, 2.0), allreduce_s=(0.0, 3.0),
                         parameter_bytes=(0.0, 1e6))
        result = simulate_schedule(schedule, costs, record_events=False)
        return result.makespan_s / 40, result.peak_memory_bytes[1]

    (deferred, _), (kept, _) = run(S.TWO_BW, False), run(S.TWO_BW, True)
    flushed, _ = run(S.FLUSH, False)
    assert deferred == pytest.approx(6.0, rel=0.03)
    assert kept == pytest.approx(6.0 + 3.0 * 0.6, rel=0.1) and kept == pytest.approx(flushed)
    one, launched = RankMemory(), RankMemory()
    launched.launch()
    for memory in (one, launched):
        memory.forward(0, 0)
    assert launched.peak_memory(1e6, 0.0, 0.0) - one.peak_memory(1e6, 0.0, 0.0) == 1e6

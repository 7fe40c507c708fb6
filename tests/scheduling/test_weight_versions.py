"""Which weight version a forward runs on, and the most versions a rank holds: 2bw's two."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.weight_versions import peak_versions, runs_on
from dreampipe.simulation.simulator import SimCosts, simulate_schedule

S = ScheduleKind


def test_2bw_runs_minibatch_k_on_update_k_minus_1_and_the_others_on_the_live_weights() -> None:
    m = 4
    assert [runs_on(S.TWO_BW, u, m, live=9) for u in range(12)] == [0] * 8 + [1] * 4
    for kind in (S.FLUSH, S.GPIPE, S.PIPEDREAM, S.ZB_H1):
        assert runs_on(kind, 11, m, live=2) == 2


def _stage_actions(kind: ScheduleKind, p: int, minibatches: int, m: int) -> list[list[int]]:
    schedule = build_schedule([1] * p, kind, minibatches * m, m)
    return [[peak_versions([a for a in acts if a.stage == s], kind, m)
             for s in sorted({a.stage for a in acts})] for acts in schedule.actions]


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 5), m_per_stage=st.integers(1, 3), minibatches=st.integers(2, 5))
def test_a_2bw_stage_holds_two_versions_once_an_update_ran(
        p: int, m_per_stage: int, minibatches: int) -> None:
    """Every 2bw stage runs a minibatch on the version before the live one: two copies;
    a flushed schedule runs every forward on the live weights: one."""
    m = p * m_per_stage
    assert _stage_actions(S.TWO_BW, p, minibatches, m) == [[2]] * p
    assert _stage_actions(S.FLUSH, p, minibatches, m) == [[1]] * p


def test_one_update_needs_no_second_version() -> None:
    assert _stage_actions(S.TWO_BW, 3, 1, 3) == [[1]] * 3


def test_the_simulator_counts_2bws_two_versions() -> None:
    p, m = 3, 3
    costs = SimCosts(forward_s=(1.0,) * p, backward_s=(2.0,) * p)
    two_bw = simulate_schedule(build_schedule([1] * p, S.TWO_BW, 4 * m, m), costs)
    flush = simulate_schedule(build_schedule([1] * p, S.FLUSH, 4 * m, m), costs)
    assert two_bw.peak_versions == (2,) * p
    assert flush.peak_versions == (1,) * p

"""Zero Bubble's zb-h1 and zb-h2: their orders, memory bounds and the W actions."""

from __future__ import annotations

import pytest

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.validator import validate_schedule
from dreampipe.scheduling.zero_bubble import zero_bubble_counts

K = ActionKind
S = ScheduleKind


def _words(text: str) -> list[str]:
    return text.split()


def _compute(acts: tuple[Action, ...]) -> list[str]:
    return [str(a) for a in acts if a.kind in (K.FORWARD, K.BACKWARD, K.WEIGHT)]


def _peak_held(acts: tuple[Action, ...]) -> int:
    """Most microbatches between their forward and their W on one rank."""
    held = peak = 0
    for a in acts:
        held += (a.kind is K.FORWARD) - (a.kind is K.WEIGHT)
        peak = max(peak, held)
    return peak


def test_zb_h1_orders_of_a_straight_pipeline() -> None:
    sched = build_schedule([1, 1, 1], S.ZB_H1, 5, 5)
    assert _compute(sched.actions[0]) == (
        _words("F0 F1 F2 B0 W0 F3 B1 W1 F4 B2 W2 B3 W3 B4 W4"))
    # the last stage puts its W off by two microbatches, to the drain
    assert _compute(sched.actions[2]) == (
        _words("F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 F4 B4 W2 W3 W4"))


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_zb_h1_holds_1f1b_peak_and_zb_h2_twice(p: int, m: int) -> None:
    h1 = build_schedule([1] * p, S.ZB_H1, m, m)
    h2 = build_schedule([1] * p, S.ZB_H2, m, m)
    flush = build_schedule([1] * p, S.FLUSH, m, m)
    top = max(_peak_held(a) for a in flush.actions)
    assert all(_peak_held(a) <= top for a in h1.actions)
    assert all(_peak_held(a) <= 2 * top - 1 for a in h2.actions)
    assert max(_peak_held(a) for a in h2.actions) == min(m, 2 * p - 1)


def test_every_backward_has_one_weight_gradient_after_it_then_the_step() -> None:
    sched = build_schedule([2, 1], S.ZB_H2, 8, 4)
    for acts in sched.actions:
        words = [str(a) for a in acts]
        for a in acts:
            if a.kind is K.BACKWARD:
                assert words.count(f"W{a.microbatch}") == 1
                assert words.index(f"W{a.microbatch}") > words.index(f"B{a.microbatch}")
        # each update's W come before its STEP
        for k in range(2):
            ws = [words.index(f"W{u}") for u in range(4 * k, 4 * k + 4) if f"W{u}" in words]
            assert max(ws) < words.index(f"STEP{k}")


def test_counts_follow_the_warm_up() -> None:
    assert zero_bubble_counts(S.ZB_H1, (4, 3, 2, 1)) == ((4, 3, 2, 1), (0, 1, 2, 3))
    assert zero_bubble_counts(S.ZB_H2, (4, 3, 2, 1)) == ((7, 5, 3, 1), (0, 2, 4, 6))


GOOD = """# zb-h1 replicas=1-1 microbatches=2 per_update=2
0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 W0 RECV_B1 B1 W1 STEP0
1: RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1 W0 W1 STEP0
"""


def test_the_built_text_is_the_reference() -> None:
    assert build_schedule([1, 1], S.ZB_H1, 2, 2) == Schedule.from_text(GOOD)


@pytest.mark.parametrize(("old", "new", "message"), [
    ("W0 W1 STEP0", "W0 STEP0", "W1 of stage 1 is missing"),
    ("1: RECV_F0 F0 B0 SEND_B0", "1: RECV_F0 F0 W0 B0 SEND_B0", "W0 runs 2 times"),
    ("SEND_B1 W0 W1", "SEND_B1 W1", "W0 of stage 1 is missing"),
    ("RECV_B0 B0 W0 RECV_B1 B1", "RECV_B0 W0 B0 RECV_B1 B1", "before B0"),
])
def test_validator_rejects_w_misplaced_or_missing(old: str, new: str, message: str) -> None:
    assert old in GOOD
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(Schedule.from_text(GOOD.replace(old, new, 1)))


def test_validator_rejects_w_in_a_schedule_that_does_not_split() -> None:
    flush = build_schedule([1, 1], S.FLUSH, 2, 2).to_text().replace("B0 SEND_B0", "B0 W0 SEND_B0")
    with pytest.raises(ScheduleError, match="remove it, or use zb-h1"):
        validate_schedule(Schedule.from_text(flush))

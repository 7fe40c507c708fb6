"""Actions and Schedule: text forms, peers, rounds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dreampipe.errors import ScheduleError
from dreampipe.planning.placement import Placement
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule


@given(st.sampled_from(list(ActionKind)), st.integers(0, 7), st.integers(0, 10**6))
def test_action_text_parses_back(kind: ActionKind, stage: int, microbatch: int) -> None:
    a = Action(kind, stage, microbatch)
    if kind is ActionKind.OVERLAP:  # an overlapped pair names its backward too
        a = Action.overlap(Action(ActionKind.FORWARD, stage, microbatch),
                           Action(ActionKind.BACKWARD, stage, microbatch // 2))
    assert Action.parse(str(a), stage) == a


@pytest.mark.parametrize("text", ["G3", "F", "F-1", "SEND3", "f3", "STEP3x"])
def test_bad_action_text_is_rejected(text: str) -> None:
    with pytest.raises(ScheduleError, match="not an action"):
        Action.parse(text, 0)


def test_text_form_examples() -> None:
    assert str(Action(ActionKind.SEND_B, 1, 3)) == "SEND_B3"
    assert str(Action(ActionKind.ALLREDUCE, 0, 12)) == "ALLREDUCE12"
    assert Action.parse("RECV_F7", 2) == Action(ActionKind.RECV_F, 2, 7)


@pytest.mark.parametrize("kind", list(ScheduleKind))
def test_schedule_text_round_trip(kind: ScheduleKind) -> None:
    replicas = (4,) if kind is ScheduleKind.DP else (2, 1, 3)
    per = 4 if kind is ScheduleKind.DP else (1 if kind is ScheduleKind.PIPEDREAM else 3)
    virtual = 1
    if kind is ScheduleKind.TWO_BW:
        per = 6  # a multiple of every stage's replicas
    if kind is ScheduleKind.INTERLEAVED:
        replicas, per, virtual = (1, 1, 1, 1, 1, 1), 3, 2  # 3 workers, 2 stages each
    if kind.placement is Placement.V:  # 3 workers, 2 stages each in a V
        replicas, per, virtual = (1, 1, 1, 1, 1, 1), 6, 2
    sched = build_schedule(replicas, kind, 12, per, virtual_stages=virtual)
    assert Schedule.from_text(sched.to_text()) == sched


def test_schedule_text_says_microbatches_and_reads_the_old_units_too() -> None:
    sched = build_schedule((2, 1), ScheduleKind.FLUSH, 4, 2)
    text = sched.to_text()
    assert text.startswith("# 1f1b-flush replicas=2-1 microbatches=4 per_update=2\n")
    old = text.replace("microbatches=", "units=", 1)
    assert Schedule.from_text(old) == sched


def test_layout_queries() -> None:
    sched = Schedule(ScheduleKind.PIPEDREAM, (2, 1, 3), tuple(() for _ in range(6)), 6)
    assert [sched.stage_of_rank(r) for r in range(6)] == [0, 0, 1, 2, 2, 2]
    assert [sched.first_rank(s) for s in range(3)] == [0, 2, 3]
    assert [sched.replica_of_rank(r) for r in range(6)] == [0, 1, 0, 0, 1, 2]
    assert [sched.rank_of(2, u) for u in range(6)] == [3, 4, 5, 3, 4, 5]
    assert sched.peer(1, Action(ActionKind.SEND_F, 0, 5)) == 2
    assert sched.peer(2, Action(ActionKind.SEND_F, 1, 5)) == 5
    assert sched.peer(5, Action(ActionKind.SEND_B, 2, 5)) == 2
    assert sched.peer(2, Action(ActionKind.SEND_B, 1, 5)) == 1
    assert sched.peer(0, Action(ActionKind.FORWARD, 0, 0)) is None
    with pytest.raises(ScheduleError, match="rank 6"):
        sched.stage_of_rank(6)


def test_allreduce_round_is_the_update_number_in_every_schedule() -> None:
    for kind, per in ((ScheduleKind.PIPEDREAM, 1), (ScheduleKind.FLUSH, 3)):
        sched = build_schedule((3, 1), kind, 6, per)
        rounds = [a.allreduce_round for a in sched.actions[1] if a.kind is ActionKind.ALLREDUCE]
        steps = [a.microbatch for a in sched.actions[1] if a.kind is ActionKind.STEP]
        assert rounds == steps == [0, 1]
    with pytest.raises(ScheduleError, match="STEP1 joins no all-reduce round"):
        _ = Action(ActionKind.STEP, 0, 1).allreduce_round


def test_transfer_semantics() -> None:
    send, recv = Action(ActionKind.SEND_F, 1, 4), Action(ActionKind.RECV_F, 2, 4)
    assert send.transfer_key == recv.transfer_key == (0, 1, 4)
    assert Action(ActionKind.SEND_B, 2, 4).transfer_key == Action(
        ActionKind.RECV_B, 1, 4).transfer_key == (1, 2, 4)
    assert (send.peer_stage, recv.peer_stage) == (2, 1)
    assert Action(ActionKind.FORWARD, 1, 4).transfer_key is None
    assert send.is_send and not recv.is_send


def test_schedule_needs_one_list_per_rank() -> None:
    with pytest.raises(ScheduleError, match="3 action lists for 4 ranks"):
        Schedule(ScheduleKind.GPIPE, (2, 2), ((), (), ()), 1)


@pytest.mark.parametrize("header", ["", "# bogus replicas=1 microbatches=1 per_update=1", "1: F0"])
def test_from_text_rejects_bad_header(header: str) -> None:
    with pytest.raises(ScheduleError):
        Schedule.from_text(header)

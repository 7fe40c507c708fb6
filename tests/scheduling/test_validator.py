"""validate_schedule(): hand-broken schedules are rejected with a marked rank-by-step grid."""

from __future__ import annotations

import pytest

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.validator import format_grid, validate_schedule


def _sched(text: str) -> Schedule:
    return Schedule.from_text(text)


GOOD = """# gpipe replicas=1-1 microbatches=2 per_update=2
0: F0 SEND_F0 F1 SEND_F1 RECV_B1 B1 RECV_B0 B0 STEP0
1: RECV_F0 F0 RECV_F1 F1 B1 SEND_B1 B0 SEND_B0 STEP0
"""


def test_good_schedule_passes() -> None:
    validate_schedule(_sched(GOOD))


def _rejects(text: str, *needles: str) -> str:
    with pytest.raises(ScheduleError) as info:
        validate_schedule(_sched(text))
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert "rank 0 s0" in message and "rank 1 s1" in message
    return message


def test_dropped_receive_is_rejected() -> None:
    broken = GOOD.replace("RECV_F1 F1", "F1")
    _rejects(broken, "without RECV_F1", ">F1<")


def test_dropped_send_and_receive_pair_is_rejected() -> None:
    broken = GOOD.replace("SEND_B1 ", "").replace("RECV_B1 ", "")
    _rejects(broken, "RECV_B1", ">B1<")


def test_unmatched_send_is_rejected() -> None:
    broken = GOOD.replace("SEND_B0 STEP0", "SEND_B0 SEND_B0 STEP0")
    _rejects(broken, "2 time(s)", "receives it 1 time(s)", ">SEND_B0<")


def test_backward_before_forward_is_rejected() -> None:
    broken = GOOD.replace("1: RECV_F0 F0 RECV_F1 F1 B1", "1: RECV_F0 F0 B1 RECV_F1 F1")
    _rejects(broken, "before F1", ">B1<", ">F1<")


def test_cyclic_wait_is_a_deadlock() -> None:
    broken = """# gpipe replicas=1-1 microbatches=1 per_update=1
0: F0 RECV_B0 SEND_F0 B0 STEP0
1: RECV_F0 F0 B0 SEND_B0 STEP0
"""
    message = _rejects(broken, "deadlock", "rank 0 waits at RECV_B0", "rank 1 waits at RECV_F0",
                       ">RECV_B0<", ">RECV_F0<")
    assert message.count(">") >= 2


def test_allreduce_rounds_out_of_order_deadlock() -> None:
    broken = """# dp replicas=2 microbatches=4 per_update=2
0: F0 B0 ALLREDUCE0 STEP0 F2 B2 ALLREDUCE1 STEP1
1: F1 B1 ALLREDUCE1 STEP1 F3 B3 ALLREDUCE0 STEP0
"""
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate_schedule(_sched(broken))
    assert ">ALLREDUCE0<" in str(info.value) and ">ALLREDUCE1<" in str(info.value)


def test_allreduce_joined_twice_is_rejected() -> None:
    # The runtime pairs collectives by order: rank 0's second ALLREDUCE0 would
    # meet rank 1's ALLREDUCE1 and rank 0's ALLREDUCE1 would wait forever.
    broken = """# dp replicas=2 microbatches=4 per_update=2
0: F0 B0 ALLREDUCE0 ALLREDUCE0 STEP0 F2 B2 ALLREDUCE1 STEP1
1: F1 B1 ALLREDUCE0 STEP0 F3 B3 ALLREDUCE1 STEP1
"""
    with pytest.raises(ScheduleError, match="2 times") as info:
        validate_schedule(_sched(broken))
    message = str(info.value)
    assert message.count(">ALLREDUCE0<") == 2 and "rank 0 s0" in message


def test_microbatch_on_the_wrong_replica_is_rejected() -> None:
    broken = """# dp replicas=2 microbatches=2 per_update=2
0: F1 B1 ALLREDUCE0 STEP0
1: F0 B0 ALLREDUCE0 STEP0
"""
    with pytest.raises(ScheduleError, match="round robin puts microbatch 1 on rank 1"):
        validate_schedule(_sched(broken))


def test_missing_and_duplicate_microbatches_are_rejected() -> None:
    with pytest.raises(ScheduleError, match="B1 of stage 0 is missing"):
        validate_schedule(_sched(
            "# dp replicas=1 microbatches=2 per_update=1\n0: F0 B0 STEP0 F1 STEP1\n"))
    with pytest.raises(ScheduleError, match="runs 2 times"):
        validate_schedule(_sched(
            "# dp replicas=1 microbatches=1 per_update=1\n0: F0 B0 F0 B0 STEP0\n"))
    with pytest.raises(ScheduleError, match=r"outside microbatches 0\.\.0"):
        validate_schedule(_sched(
            "# dp replicas=1 microbatches=1 per_update=1\n0: F0 B0 F5 B5 STEP0\n"))


def test_send_off_the_end_of_the_pipeline_is_rejected() -> None:
    broken = GOOD.replace("1: RECV_F0 F0 RECV_F1 F1 B1", "1: RECV_F0 F0 SEND_F0 RECV_F1 F1 B1")
    with pytest.raises(ScheduleError, match=r"talks to stage 2 outside 0\.\.1"):
        validate_schedule(_sched(broken))


@pytest.mark.parametrize("kind", list(ScheduleKind))
def test_built_schedules_validate(kind: ScheduleKind) -> None:
    replicas = (3,) if kind is ScheduleKind.DP else (2, 1, 2)
    per = 3 if kind is ScheduleKind.DP else (1 if kind is ScheduleKind.PIPEDREAM else 4)
    virtual = 1
    if kind is ScheduleKind.INTERLEAVED:
        replicas, per, virtual = (1, 1, 1, 1, 1, 1), 6, 3  # 2 workers, 3 stages each
    if kind in (ScheduleKind.ZBV, ScheduleKind.DUALPIPEV):  # 3 workers, 2 stages each, a V
        replicas, per, virtual = (1, 1, 1, 1, 1, 1), 6, 2
    validate_schedule(build_schedule(replicas, kind, 12, per, virtual_stages=virtual))


def test_grid_windows_long_schedules_around_the_mark() -> None:
    sched = build_schedule([1, 1], ScheduleKind.PIPEDREAM, 40)
    grid = format_grid(sched, [(1, 60)])
    lines = grid.splitlines()
    assert len(lines) == 3
    assert "(steps 52..68 of" in lines[0]
    assert lines[2].count(">") == 1 and f">{sched.actions[1][60]}<" in lines[2]
    assert str(sched.actions[0][0]) not in lines[1].split()


def test_replica_skipping_a_round_is_rejected() -> None:
    # 3 minibatches on 2 replicas: round 1 holds only microbatch 2 (replica 0), and
    # replica 1 must still join it or replica 0 waits forever at ALLREDUCE1.
    broken = """# pipedream replicas=2 microbatches=3 per_update=1
0: F0 B0 ALLREDUCE0 STEP0 F2 B2 ALLREDUCE1 STEP1
1: F1 B1 ALLREDUCE0 STEP0
"""
    with pytest.raises(ScheduleError, match="rank 1, a replica of the same stage, never") as info:
        validate_schedule(_sched(broken))
    message = str(info.value)
    assert "add ALLREDUCE1 STEP1 to rank 1" in message
    assert ">ALLREDUCE1<" in message and ">(end)<" in message
    validate_schedule(_sched(broken.replace("ALLREDUCE0 STEP0\n", "ALLREDUCE0 STEP0 "
                                            "ALLREDUCE1 STEP1\n")))

"""PipeDream-2BW: 1F1B without a flush, one update per minibatch after its last backward."""

from __future__ import annotations

import pytest

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import ActionKind, ScheduleKind
from dreampipe.scheduling.build import build_schedule

K = ActionKind
S = ScheduleKind


def _words(text: str) -> list[str]:
    return text.split()


def test_2bw_steps_after_each_minibatch_last_backward_without_a_flush() -> None:
    sched = build_schedule([1, 1], S.TWO_BW, 6, 2)
    words = [str(a) for a in sched.actions[0] if a.kind in (K.FORWARD, K.BACKWARD, K.STEP)]
    assert words == _words("F0 F1 B0 F2 B1 STEP0 F3 B2 F4 B3 STEP1 F5 B4 B5 STEP2")


def test_2bw_replicas_all_reduce_once_per_minibatch() -> None:
    sched = build_schedule([2, 1], S.TWO_BW, 8, 4)
    for rank in (0, 1):
        acts = sched.actions[rank]
        rounds = [a.microbatch for a in acts if a.kind is K.ALLREDUCE]
        assert rounds == [0, 1]
        for k in rounds:
            last = max(a.microbatch for a in acts
                       if a.kind is K.BACKWARD and a.microbatch // 4 == k)
            i = acts.index(next(a for a in acts if a.kind is K.ALLREDUCE and a.microbatch == k))
            assert acts[i - 1].microbatch == last  # right after that backward (and its send)


def test_2bw_needs_whole_rounds_per_minibatch() -> None:
    with pytest.raises(ScheduleError, match="multiple of 6"):
        build_schedule([2, 3], S.TWO_BW, 8, 4)

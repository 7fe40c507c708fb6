"""PipeDream-2BW: 1F1B without a flush, one update per minibatch after its last backward."""

from __future__ import annotations

import pytest

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import ActionKind, ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.updates import launched_rounds
from dreampipe.scheduling.weight_versions import runs_on

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


@pytest.mark.parametrize(("replicas", "m"), [((1, 2), 4), ((2, 1), 4), ((1, 1, 5), 20),
                                             ((2, 2), 8)])
def test_a_replicated_stage_steps_after_its_last_forward_of_the_next_minibatch(
    replicas: tuple[int, ...], m: int
) -> None:
    """Its all-reduce then overlaps minibatch ``k + 1``'s work, which runs on the weights
    before update ``k`` anyway; ``STEP<k>`` still comes before any action of minibatch
    ``k + 2``, whose forwards run on update ``k``'s weights, and before ``ALLREDUCE<k+1>``.
    A stage of one replica, or a run whose ranks agree at each update, or ZeRO 2, keeps
    its step right after its all-reduce."""
    sched = build_schedule(list(replicas), S.TWO_BW, 4 * m, m)
    for rank, acts in enumerate(sched.actions):
        stage = sched.stage_of_rank(rank)
        where = {(a.kind, a.microbatch): i for i, a in enumerate(acts)
                 if a.kind in (K.ALLREDUCE, K.STEP)}
        for k in range(4):
            step = where[(K.STEP, k)]
            later = [i for i, a in enumerate(acts) if a.kind not in (K.ALLREDUCE, K.STEP)
                     and sched.last_microbatch(a) // m >= k + 2]
            assert all(step < i for i in later)
            assert runs_on(S.TWO_BW, (k + 2) * m, m, 0) == k + 1
            if replicas[stage] == 1:
                continue
            assert (K.ALLREDUCE, k + 1) not in where or step < where[(K.ALLREDUCE, k + 1)]
            between = acts[where[(K.ALLREDUCE, k)] + 1 : step]
            if k < 3:  # the last minibatch has no next one to overlap
                assert any(a.kind is K.FORWARD and a.microbatch // m == k + 1
                           for a in between), (rank, k, [str(a) for a in acts])
        assert bool(launched_rounds(acts)) == (replicas[stage] > 1)
    for agree, zero in ((True, None), (False, [2] * len(replicas))):
        kept = build_schedule(list(replicas), S.TWO_BW, 4 * m, m, zero=zero, steps_agree=agree)
        assert not any(launched_rounds(acts) for acts in kept.actions)

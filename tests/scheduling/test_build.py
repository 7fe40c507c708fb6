"""build_schedule: the five schedules, their orders, lowering passes and input errors."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.errors import ScheduleError
from dreampipe.planning.in_flight import in_flight_counts
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.build import (
    build_schedule,
    compute_schedule,
    lower_communication,
    lower_updates,
    whole_rounds,
)
from dreampipe.scheduling.validator import validate_schedule

K = ActionKind
S = ScheduleKind


def _words(text: str) -> list[str]:
    return text.split()


def _compute(acts: tuple[Action, ...]) -> list[str]:
    return [str(a) for a in acts if a.kind in (K.FORWARD, K.BACKWARD)]


def _forwards_before_first_backward(acts: tuple[Action, ...]) -> int:
    kinds = [a.kind for a in acts if a.kind in (K.FORWARD, K.BACKWARD)]
    return kinds.index(K.BACKWARD)


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_pipedream_straight_warmup_is_n_minus_s(n: int) -> None:
    sched = build_schedule([1] * n, S.PIPEDREAM, 3 * n)
    for s in range(n):
        assert _forwards_before_first_backward(sched.actions[s]) == n - s


def test_pipedream_straight_order_is_one_forward_one_backward() -> None:
    sched = build_schedule([1, 1, 1], S.PIPEDREAM, 6)
    assert _compute(sched.actions[0]) == _words("F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5")
    assert _compute(sched.actions[2]) == _words("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5")


@pytest.mark.parametrize("replicas", [(3, 1), (2, 1, 1), (15, 1), (2, 3, 1), (4, 4, 4, 4)])
def test_pipedream_input_stage_admits_noam_with_no_join_buffer(replicas: tuple[int, ...]) -> None:
    microbatches = 3 * math.lcm(*replicas) * max(replicas)
    sched = build_schedule(replicas, S.PIPEDREAM, microbatches,
                           in_flight=in_flight_counts(replicas, 0, aligned=False))
    noam = math.ceil(sum(replicas) / replicas[0])
    for rank in range(replicas[0]):
        assert _forwards_before_first_backward(sched.actions[rank]) == noam


# (replicas, minibatches in flight per stage by default): ceil((W_s + 2 E_s) / r_s) with
# E_s the replicas beyond one of stages s.. (0 at the last stage), then each stage's total
# over its replicas raised, last stage up, to the next stage's plus r when both have r
# replicas, else max(lcm(r_s, r_s+1), 2 max(r_s, r_s+1)), in whole minibatches per
# replica; worked by hand
_JOINED = [
    ((1, 1, 1), (3, 2, 1)),  # straight: PipeDream's n - s
    ((4,), (1,)),  # data parallelism
    ((3, 1), (3, 1)),  # (4 + 4) / 3; 9 >= 1 + 6
    ((15, 1), (3, 1)),  # (16 + 28) / 15; 45 >= 1 + 30
    ((1, 2), (6, 1)),  # (3 + 2) / 1 = 5 < 2 + 4
    ((2, 3, 1), (8, 3, 1)),  # (6 + 6) / 2, (4 + 4) / 3; 9 >= 1 + 6, 12 < 9 + 6 -> 16
    ((4, 4, 4, 4), (10, 8, 5, 1)),  # (16 + 24) / 4, (12 + 18) / 4, (8 + 12) / 4: 40, 32, 20, 4
]


@pytest.mark.parametrize(("replicas", "expect"), _JOINED)
def test_pipedream_default_warmup_covers_the_all_reduce_joins(
    replicas: tuple[int, ...], expect: tuple[int, ...]
) -> None:
    assert in_flight_counts(replicas) == expect
    sched = build_schedule(replicas, S.PIPEDREAM, 4 * sum(expect) * max(replicas))
    for rank, acts in enumerate(sched.actions):
        assert _forwards_before_first_backward(acts) == expect[sched.stage_of_rank(rank)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.integers(0, 3), st.booleans())
def test_every_join_buffer_gives_a_valid_schedule(replicas: list[int], join: int,
                                                  aligned: bool) -> None:
    counts = in_flight_counts(replicas, join, aligned=aligned)
    pipedream = in_flight_counts(replicas, 0, aligned=False)
    joined = in_flight_counts(replicas, join, aligned=False)
    assert all(c >= j >= p for c, j, p in zip(counts, joined, pipedream, strict=True))
    if aligned:  # each stage's total leads the next's by a whole exchange of rounds
        totals = [c * r for c, r in zip(counts, replicas, strict=True)]
        for s in range(len(replicas) - 1):
            a, b = replicas[s], replicas[s + 1]
            lead = a if a == b else max(math.lcm(a, b), 2 * max(a, b))
            assert totals[s] >= totals[s + 1] + lead
            assert (counts[s] - 1) * a < max(joined[s] * a, totals[s + 1] + lead)  # no more
    microbatches = 2 * sum(replicas) + 3
    sched = build_schedule(replicas, S.PIPEDREAM, microbatches, in_flight=counts)  # validated
    for rank, acts in enumerate(sched.actions):
        stage = sched.stage_of_rank(rank)
        mine = sum(1 for a in acts if a.kind is K.FORWARD)
        assert _forwards_before_first_backward(acts) == min(counts[stage], mine)


@pytest.mark.parametrize(("kind", "counts"), [(S.PIPEDREAM, (2,)), (S.PIPEDREAM, (2, 0)),
                                               (S.FLUSH, (2, 1))])
def test_in_flight_must_fit_the_pipedream_schedule(kind: ScheduleKind,
                                                   counts: tuple[int, ...]) -> None:
    with pytest.raises(ScheduleError, match="one count >= 1 per stage"):
        build_schedule((1, 1), kind, 4, 2 if kind is S.FLUSH else 1, in_flight=counts)


def test_round_robin_replicas_run_forward_and_backward_of_their_microbatches() -> None:
    sched = build_schedule((3, 1), S.PIPEDREAM, 9)
    for rank in range(3):
        microbatches = {a.microbatch for a in sched.actions[rank] if a.kind in (K.FORWARD,
                                                                                K.BACKWARD)}
        assert microbatches == {u for u in range(9) if u % 3 == rank}


def test_pipedream_updates_after_every_backward() -> None:
    sched = build_schedule((2, 1), S.PIPEDREAM, 4)
    assert [str(a) for a in sched.actions[2]] == _words(
        "RECV_F0 F0 B0 SEND_B0 STEP0 RECV_F1 F1 B1 SEND_B1 STEP1 "
        "RECV_F2 F2 B2 SEND_B2 STEP2 RECV_F3 F3 B3 SEND_B3 STEP3")
    assert [str(a) for a in sched.actions[1]] == _words(
        "F1 SEND_F1 F3 SEND_F3 RECV_B1 B1 ALLREDUCE0 STEP0 RECV_B3 B3 ALLREDUCE1 STEP1")


def test_flush_one_update_per_minibatch_with_capped_warmup() -> None:
    sched = build_schedule((1, 1, 1), S.FLUSH, 8, 2)
    text0 = [str(a) for a in sched.actions[0] if a.kind not in (K.SEND_F, K.RECV_B)]
    assert text0 == _words("F0 F1 B0 B1 STEP0 F2 F3 B2 B3 STEP1 F4 F5 B4 B5 STEP2 "
                           "F6 F7 B6 B7 STEP3")
    long = build_schedule((1, 1, 1), S.FLUSH, 8, 8)
    assert _compute(long.actions[0])[:4] == ["F0", "F1", "F2", "B0"]
    assert _compute(long.actions[1])[:3] == ["F0", "F1", "B0"]


def test_gpipe_all_forwards_then_backwards_last_first() -> None:
    sched = build_schedule((1, 1), S.GPIPE, 6, 3)
    assert _compute(sched.actions[1]) == _words("F0 F1 F2 B2 B1 B0 F3 F4 F5 B5 B4 B3")
    steps = [a for a in sched.actions[0] if a.kind is K.STEP]
    assert [a.microbatch for a in steps] == [0, 1]


def test_dp_each_update_allreduces_then_steps() -> None:
    sched = build_schedule((2,), S.DP, 8, 4)
    assert [str(a) for a in sched.actions[1]] == _words(
        "F1 B1 F3 B3 ALLREDUCE0 STEP0 F5 B5 F7 B7 ALLREDUCE1 STEP1")


def test_naive_runs_each_microbatch_through_before_the_next() -> None:
    sched = build_schedule((1, 1), S.NAIVE, 2, 2)
    assert [str(a) for a in sched.actions[0]] == _words(
        "F0 SEND_F0 RECV_B0 B0 F1 SEND_F1 RECV_B1 B1 STEP0")


def test_sync_replica_without_microbatches_still_joins_the_allreduce() -> None:
    sched = build_schedule((3, 1), S.FLUSH, 2, 1)
    assert [str(a) for a in sched.actions[2]] == _words("ALLREDUCE0 STEP0 ALLREDUCE1 STEP1")


def test_lower_communication_wraps_compute_with_transfers() -> None:
    base = compute_schedule((1, 1, 1), S.NAIVE, 1, 1)
    assert [str(a) for a in base.actions[1]] == ["F0", "B0"]
    lowered = lower_communication(base)
    assert [str(a) for a in lowered.actions[0]] == ["F0", "SEND_F0", "RECV_B0", "B0"]
    assert [str(a) for a in lowered.actions[1]] == [
        "RECV_F0", "F0", "SEND_F0", "RECV_B0", "B0", "SEND_B0"]
    assert [str(a) for a in lowered.actions[2]] == ["RECV_F0", "F0", "B0", "SEND_B0"]


def test_lower_updates_alone() -> None:
    base = compute_schedule((2,), S.DP, 4, 2)
    done = lower_updates(base)
    assert [str(a) for a in done.actions[0]] == _words(
        "F0 B0 ALLREDUCE0 STEP0 F2 B2 ALLREDUCE1 STEP1")


@pytest.mark.parametrize(("replicas", "kind", "microbatches", "per", "match"), [
    ((1, 1), S.GPIPE, 0, 1, "at least 1"),
    ((1, 1), S.GPIPE, 5, 2, "run 6 microbatches"),
    ((1, 0), S.GPIPE, 4, 2, "at least one stage"),
    ((), S.GPIPE, 4, 2, "at least one stage"),
    ((1, 1), S.PIPEDREAM, 4, 2, "microbatches_per_update=2"),
    ((2, 2), S.DP, 4, 4, "use replicas \\(4,\\)"),
    ((4,), S.DP, 6, 6, "multiple of 4"),
    ((1,), S.FLUSH, 4, 0, "microbatches_per_update=0"),
])
def test_bad_inputs_say_how_to_fix(
    replicas: tuple[int, ...], kind: ScheduleKind, microbatches: int, per: int, match: str
) -> None:
    with pytest.raises(ScheduleError, match=match):
        build_schedule(replicas, kind, microbatches, per)


def test_build_schedule_returns_plain_data() -> None:
    sched = build_schedule([2, 1], S.PIPEDREAM, 4)
    assert isinstance(sched, Schedule)
    assert sched.replicas == (2, 1) and sched.num_microbatches == 4
    assert sched.microbatches_per_update == 1
    total_f = sum(1 for acts in sched.actions for a in acts if a.kind is K.FORWARD)
    assert total_f == 4 * 2


@pytest.mark.parametrize(("replicas", "wanted", "expected"),
                         [((1, 1), 5, 5), ((2, 1), 5, 6), ((3, 2), 7, 12), ((4,), 0, 4)])
def test_whole_rounds(replicas: tuple[int, ...], wanted: int, expected: int) -> None:
    assert whole_rounds(replicas, wanted) == expected


def _rounds(acts: tuple[Action, ...], kind: ActionKind) -> list[int]:
    return [a.microbatch for a in acts if a.kind is kind]


def test_partial_last_round_is_joined_by_every_replica() -> None:
    # 5 minibatches: stage 0 (3 replicas) runs rounds {0,1,2} {3,4}; stage 1 (2
    # replicas) {0,1} {2,3} {4}. A replica with no microbatch in the last round joins it last.
    sched = build_schedule((3, 2), S.PIPEDREAM, 5)
    assert [str(a) for a in sched.actions[2]] == _words(
        "F2 SEND_F2 RECV_B2 B2 ALLREDUCE0 STEP0 ALLREDUCE1 STEP1")
    assert [str(a) for a in sched.actions[4]] == _words(
        "RECV_F1 F1 B1 SEND_B1 ALLREDUCE0 STEP0 RECV_F3 F3 B3 SEND_B3 ALLREDUCE1 STEP1 "
        "ALLREDUCE2 STEP2")
    assert _rounds(sched.actions[3], K.ALLREDUCE) == [0, 1, 2]


@pytest.mark.parametrize(("replicas", "microbatches"), [
    ((3, 2), 5), ((3, 2), 7), ((3, 2), 1), ((5, 7), 3), ((5, 7), 34), ((5, 7), 36),
    ((1, 4, 1), 6), ((2,), 3),
])
def test_any_number_of_minibatches_builds(replicas: tuple[int, ...], microbatches: int) -> None:
    assert microbatches % math.lcm(*replicas)  # not whole rounds
    sched = build_schedule(replicas, S.PIPEDREAM, microbatches)
    for rank, acts in enumerate(sched.actions):
        r = replicas[sched.stage_of_rank(rank)]
        rounds = list(range(-(-microbatches // r)))
        assert _rounds(acts, K.STEP) == rounds
        assert _rounds(acts, K.ALLREDUCE) == (rounds if r > 1 else [])
    assert sum(a.kind is K.BACKWARD for acts in sched.actions for a in acts) == (
        microbatches * len(replicas))


@settings(max_examples=60, deadline=None)
@given(replicas=st.lists(st.integers(1, 7), min_size=1, max_size=4),
       microbatches=st.integers(1, 60))
def test_validator_accepts_every_pipedream_schedule(replicas: list[int], microbatches: int) -> None:
    sched = build_schedule(replicas, S.PIPEDREAM, microbatches)  # validates
    validate_schedule(sched)
    # Every replica takes the same updates, one per round of its stage.
    for rank, acts in enumerate(sched.actions):
        assert len(_rounds(acts, K.STEP)) == -(-microbatches // replicas[sched.stage_of_rank(rank)])


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from([ScheduleKind.FLUSH, ScheduleKind.GPIPE, ScheduleKind.NAIVE]),
    replicas=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    per_update=st.integers(1, 6),
    updates=st.integers(1, 9),
)
def test_a_synchronous_schedule_is_its_period_repeated(
    kind: ScheduleKind, replicas: list[int], per_update: int, updates: int
) -> None:
    """The repeated period equals what the passes build for the whole run, and is valid."""
    from dreampipe.scheduling.build import _built

    direct = _built(tuple(replicas), kind, per_update * updates, per_update)
    fast = build_schedule(replicas, kind, per_update * updates, per_update)
    assert fast == direct
    validate_schedule(fast)

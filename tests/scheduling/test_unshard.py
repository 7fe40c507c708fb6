"""ZeRO-3 in the schedule: where UNSHARD and RESHARD go, what the validator refuses, and
what the simulator charges for them (:mod:`dreampipe.scheduling.unshard`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.unshard import pairs_per_use, place_unshards
from dreampipe.scheduling.validator import validate_schedule
from dreampipe.simulation.simulator import SimCosts, simulate_schedule

K, S = ActionKind, ScheduleKind
SYNC = [S.FLUSH, S.GPIPE, S.ZB_H1, S.ZB_H2, S.NAIVE]
_COMPUTE = (K.FORWARD, K.BACKWARD, K.WEIGHT)


@settings(max_examples=80, deadline=None)
@given(replicas=st.lists(st.integers(1, 3), min_size=1, max_size=4),
       kind=st.sampled_from(SYNC), per=st.integers(1, 5), updates=st.integers(1, 3),
       levels=st.lists(st.integers(0, 3), min_size=4, max_size=4))
def test_each_update_is_gathered_once_around_all_its_computations(
    replicas: list[int], kind: ScheduleKind, per: int, updates: int, levels: list[int]
) -> None:
    zero = levels[:len(replicas)]
    sched = build_schedule(replicas, kind, per * updates, per, zero=zero)
    plain = build_schedule(replicas, kind, per * updates, per)
    assert Schedule.from_text(sched.to_text()) == sched  # the text round trip keeps them
    for rank, acts in enumerate(sched.actions):
        stage = sched.stage_of_rank(rank)
        marks = [a for a in acts if a.kind in (K.UNSHARD, K.RESHARD)]
        # the pass only adds: without its actions each list is the plain schedule's
        assert tuple(a for a in acts if a not in marks) == plain.actions[rank]
        if zero[stage] < 3 or replicas[stage] == 1:
            assert not marks
            continue
        assert marks == [Action(k, stage, u) for u in range(updates)
                         for k in (K.UNSHARD, K.RESHARD)]  # every replica joins every gather
        where = {a: i for i, a in enumerate(acts)}
        for u in range(updates):
            lo, hi = where[Action(K.UNSHARD, stage, u)], where[Action(K.RESHARD, stage, u)]
            mine = [i for i, a in enumerate(acts) if a.kind in _COMPUTE and a.microbatch // per
                    == u]
            assert all(lo < i < hi for i in mine)
            if mine:  # gathered just before the first computation (or its receive), freed
                assert hi == mine[-1] + 1  # just after the last
                assert all(acts[i].kind is K.RECV_F for i in range(lo + 1, mine[0]))
            else:  # nothing to compute: a gather joined just before the update's all-reduce
                assert acts[hi + 1] == Action(K.ALLREDUCE, stage, u)


def test_a_later_stage_gathers_while_its_input_arrives() -> None:
    sched = build_schedule([1, 2], S.FLUSH, 4, 4, zero=[3, 3])
    assert sched.to_text().splitlines()[2] == (
        "1: UNSHARD0 RECV_F0 F0 B0 SEND_B0 RECV_F2 F2 B2 RESHARD0 SEND_B2 ALLREDUCE0 STEP0")


def test_asynchronous_schedules_are_refused() -> None:
    for kind, per in ((S.PIPEDREAM, 1), (S.TWO_BW, 2)):
        with pytest.raises(ScheduleError, match=rf"ZeRO level 3 on stage 0 with the "
                           rf"{kind.value} schedule: its microbatches in flight"):
            build_schedule([2, 1], kind, 4, per, zero=[3, 0])
    plain = build_schedule([2, 1], S.PIPEDREAM, 4, 1)
    assert place_unshards(plain, [2, 3]) == plain  # stage 1 has one replica: nothing to do


GOOD = """# 1f1b-flush replicas=2-1 microbatches=4 per_update=4
0: UNSHARD0 F0 SEND_F0 F2 SEND_F2 RECV_B0 B0 RECV_B2 B2 RESHARD0 ALLREDUCE0 STEP0
1: UNSHARD0 F1 SEND_F1 F3 SEND_F3 RECV_B1 B1 RECV_B3 B3 RESHARD0 ALLREDUCE0 STEP0
2: RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1 RECV_F2 F2 B2 SEND_B2 RECV_F3 F3 B3 SEND_B3 STEP0
"""


def _rejects(text: str, *needles: str) -> None:
    with pytest.raises(ScheduleError) as info:
        validate_schedule(Schedule.from_text(text))
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_the_built_schedule_is_the_one_written_here() -> None:
    validate_schedule(Schedule.from_text(GOOD))
    assert build_schedule([2, 1], S.FLUSH, 4, 4, zero=[3, 3]).to_text() == GOOD.strip()


@pytest.mark.parametrize(("old", "new", "needles"), [
    ("RECV_B2 B2 RESHARD0", "RESHARD0 RECV_B2 B2", ("runs B2 of stage 0", "sharded",
                                                    "between UNSHARD0 and RESHARD0", ">B2<")),
    ("0: UNSHARD0 F0", "0: F0 UNSHARD0", ("runs F0 of stage 0", ">F0<")),
    ("B2 RESHARD0 ALLREDUCE0", "B2 ALLREDUCE0", ("never releases UNSHARD0", ">UNSHARD0<")),
    ("0: UNSHARD0 F0", "0: F0", ("runs F0 of stage 0",)),
    ("1: UNSHARD0 F1", "1: UNSHARD0 UNSHARD0 F1", ("UNSHARD0 at step 0 is not released",)),
    ("0: UNSHARD0 F0", "0: RESHARD0 UNSHARD0 F0", ("RESHARD0 at step 0 without UNSHARD0",)),
    ("SEND_B3 STEP0", "SEND_B3 STEP0 UNSHARD0 RESHARD0", ("stage 1 has one replica",
                                                          "nothing to gather")),
])
def test_the_validator_refuses_a_broken_gather(old: str, new: str, needles: tuple[str, ...]
                                               ) -> None:
    assert old in GOOD
    _rejects(GOOD.replace(old, new, 1), *needles)


def test_a_replica_that_skips_a_gather_is_refused() -> None:
    text = GOOD.replace("1: UNSHARD0 F1", "1: F1").replace("B3 RESHARD0", "B3")
    text = text.replace("1: F1", "1: UNSHARD1 F1").replace("B3 ALLREDUCE0", "B3 RESHARD1 "
                                                             "ALLREDUCE0")
    _rejects(text, "UNSHARD1 at step 0", "outside 0..0")
    two = build_schedule([2, 1], S.FLUSH, 8, 4, zero=[3, 3]).to_text()
    broken = two.replace("1: UNSHARD0 F1", "1: F1").replace("B3 RESHARD0", "B3")
    _rejects(broken, "runs F1 of stage 0")


def test_an_asynchronous_schedule_with_a_gather_is_refused() -> None:
    text = ("# pipedream replicas=2 microbatches=2 per_update=1\n"
            "0: UNSHARD0 F0 B0 RESHARD0 ALLREDUCE0 STEP0\n1: F1 B1 ALLREDUCE0 STEP0\n")
    with pytest.raises(ScheduleError, match="in the pipedream schedule its microbatches in "
                       "flight run on a weight version each"):
        validate_schedule(Schedule.from_text(text))


def test_the_simulator_charges_one_gather_an_update_and_frees_the_weights_between() -> None:
    costs = SimCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), allreduce_s=(0.5, 0.0),
                     parameter_bytes=(1000.0, 1000.0))
    plain = simulate_schedule(build_schedule([2, 1], S.FLUSH, 12, 4), costs)
    zero3 = simulate_schedule(build_schedule([2, 1], S.FLUSH, 12, 4, zero=[3, 0]), costs)
    assert costs.gather_s == (0.25, 0.0)  # half an all-reduce by default
    # stage 0 starts each of the 3 updates a gather later; the pipeline waits on it
    assert zero3.makespan_s == pytest.approx(plain.makespan_s + 3 * 0.25)
    gathers = [e for e in zero3.events if e.kind is K.UNSHARD]
    assert len(gathers) == 6 and all(e.duration_s == pytest.approx(0.25) for e in gathers)
    # the peak comes while the weights are whole, so no less than without ZeRO-3
    assert zero3.peak_memory_bytes == plain.peak_memory_bytes
    slow = simulate_schedule(build_schedule([2, 1], S.FLUSH, 12, 4, zero=[3, 0]),
                             SimCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0),
                                      allreduce_s=(0.5, 0.0), gather_s=(1.0, 0.0)))
    assert slow.makespan_s == pytest.approx(plain.makespan_s + 3 * 1.0)
    with pytest.raises(ScheduleError, match=r"costs.gather_s=\[-1.0\]"):
        SimCosts(forward_s=(1.0,), backward_s=(1.0,), gather_s=(-1.0,))


@settings(max_examples=60, deadline=None)
@given(replicas=st.integers(1, 4), kind=st.sampled_from(SYNC), per=st.integers(1, 6),
       updates=st.integers(1, 3))
def test_gathers_go_per_use_exactly_where_every_replica_runs_as_many_microbatches(
    replicas: int, kind: ScheduleKind, per: int, updates: int
) -> None:
    """Per-use gathers pair up only between replicas that run the same number of
    forwards in each update; round robin gives that when the replicas divide the update."""
    sched = build_schedule([replicas, 1], kind, per * updates, per)
    counts = {tuple(sum(a.kind is K.FORWARD and a.microbatch // per == k for a in acts)
                    for k in range(updates))
              for rank, acts in enumerate(sched.actions) if sched.stage_of_rank(rank) == 0}
    assert pairs_per_use(sched, 0) is (len(counts) == 1)
    assert pairs_per_use(sched, 0) is (per % replicas == 0 or replicas == 1)
    assert pairs_per_use(sched, 1)  # one replica pairs with itself

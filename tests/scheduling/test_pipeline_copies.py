"""Several stages a rank on replicated stages: copies of the pipeline (PP x DP)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule, forward_only
from dreampipe.simulation.action_costs import SimCosts
from dreampipe.simulation.simulator import simulate_schedule

K = ActionKind
S = ScheduleKind


@st.composite
def _copies(draw: st.DrawFn) -> tuple[S, int, int, int, int, int]:
    """(kind, replicas, ranks a copy, stages a rank, microbatches an update, updates)."""
    kind = draw(st.sampled_from([S.INTERLEAVED, S.ZBV, S.DUALPIPEV]))
    r, p = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    v = draw(st.integers(2, 3)) if kind is S.INTERLEAVED else 2
    unit = {S.INTERLEAVED: p, S.ZBV: 1, S.DUALPIPEV: p * v}[kind]
    return kind, r, p, v, r * unit * draw(st.integers(1, 2)), draw(st.integers(1, 2))


@settings(max_examples=40, deadline=None)
@given(_copies())
def test_each_copy_runs_every_microbatch_of_its_replica_then_reduces(
        case: tuple[S, int, int, int, int, int]) -> None:
    """Every microbatch ``u`` runs its ``F`` before its ``B`` on every stage, once, on
    the replica ``u mod r`` of the stage (rank ``position * r + u mod r``); each rank
    reduces each of its stages' gradients after its last ``B``/``W`` of the update, and
    all of them before its first step of it (which sums tied weights and the norm over
    its stages); and each copy runs the unreplicated schedule's order on its microbatches."""
    kind, r, p, v, m, updates = case
    n = p * v
    sched = build_schedule((r,) * n, kind, m * updates, m, virtual_stages=v)
    single = build_schedule((1,) * n, kind, m * updates // r, m // r, virtual_stages=v)
    assert sched.num_ranks == p * r
    seen: dict[tuple[K, int, int], tuple[int, int]] = {}
    for rank, acts in enumerate(sched.actions):
        position, replica = divmod(rank, r)
        assert sched.stages_of_rank(rank) == single.stages_of_rank(position)
        for i, whole in enumerate(acts):
            for a in whole.parts:
                if a.kind in (K.FORWARD, K.BACKWARD, K.WEIGHT):
                    assert a.microbatch % r == replica, (rank, str(a))
                    assert (a.kind, a.stage, a.microbatch) not in seen
                    seen[a.kind, a.stage, a.microbatch] = (rank, i)
        for stage in sched.stages_of_rank(rank):
            for k in range(updates):
                mine = [i for i, a in enumerate(acts) for part in a.parts
                        if part.kind in (K.BACKWARD, K.WEIGHT) and part.stage == stage
                        and part.microbatch // m == k]
                reduce = acts.index(next(a for a in acts if a.kind is K.ALLREDUCE
                                         and a.stage == stage and a.microbatch == k)) \
                    if r > 1 else None
                step = acts.index(next(a for a in acts if a.kind is K.STEP
                                       and a.stage == stage and a.microbatch == k))
                assert reduce is None or max(mine) < reduce < step
                assert max(mine) < step
        for k in range(updates):
            reduces = [i for i, a in enumerate(acts) if a.kind is K.ALLREDUCE
                       and a.microbatch == k]
            steps = [i for i, a in enumerate(acts) if a.kind is K.STEP and a.microbatch == k]
            assert len(reduces) == (v if r > 1 else 0) and len(steps) == v
            assert max(reduces, default=-1) < min(steps), (rank, k)
        # the copy's order is the unreplicated one, its microbatches renumbered
        share = m // r
        mine_order = [(a.kind, a.stage, a.microbatch) for a in acts
                      if a.kind in (K.FORWARD, K.BACKWARD, K.WEIGHT)]
        theirs = [(a.kind, a.stage, (a.microbatch // share) * m + a.microbatch % share * r
                   + replica) for a in single.actions[position]
                  if a.kind in (K.FORWARD, K.BACKWARD, K.WEIGHT)]
        assert mine_order == theirs
    for stage in range(n):
        for u in range(m * updates):
            f, b = seen[K.FORWARD, stage, u], seen[K.BACKWARD, stage, u]
            assert f[0] == b[0] == sched.rank_of(stage, u) and f[1] <= b[1]
    assert Schedule.from_text(sched.to_text()) == sched


def test_copies_simulate_as_fast_as_one_copy_on_its_share() -> None:
    """r copies of a pipeline each run 1/r of the microbatches: as long as one copy
    running its share alone, but for the all-reduces, which here overlap the drain."""
    costs = SimCosts(forward_s=(1.0,) * 4, backward_s=(2.0,) * 4, weight_grad_s=(1.0,) * 4)
    for kind in (S.INTERLEAVED, S.ZBV, S.DUALPIPEV):
        one = simulate_schedule(build_schedule((1,) * 4, kind, 8, 4, virtual_stages=2), costs)
        two = simulate_schedule(build_schedule((2,) * 4, kind, 16, 8, virtual_stages=2), costs)
        assert two.makespan_s == one.makespan_s, kind
        assert two.busy_s == tuple(b for b in one.busy_s for _ in range(2)), kind  # q r + j


def test_forward_only_runs_each_copy_stage_after_stage() -> None:
    sched = forward_only((2,) * 4, 4, virtual_stages=2, kind=S.INTERLEAVED)
    assert [[str(a) for a in acts if a.kind is K.FORWARD] for acts in sched.actions] == [
        ["F0", "F2", "F0", "F2"], ["F1", "F3", "F1", "F3"],
        ["F0", "F2", "F0", "F2"], ["F1", "F3", "F1", "F3"]]
    assert [sched.stages_of_rank(r) for r in range(4)] == [(0, 2), (0, 2), (1, 3), (1, 3)]


@pytest.mark.parametrize(("replicas", "kind", "per", "message"), [
    ((2, 2, 1, 1), S.INTERLEAVED, 8, r"stage 2 shares position 0's ranks with stage 0"),
    ((2, 1, 1, 2), S.DUALPIPEV, 8, r"which replicas of different counts deal apart: give "
                                   r"every stage 1 \(or 2\) replicas, or use zbv"),
    ((3, 1, 1, 3), S.ZBV, 4, r"it needs a multiple of 3, so that a position's replicas take "
                             r"equal shares round-robin: use 6 \(a multiple of 3\)"),
    ((3,) * 4, S.INTERLEAVED, 9, r"multiple of the 2 ranks a copy: use 12 \(a multiple of 6\)"),
    ((2,) * 4, S.ZBV, 5, r"must be whole: use 6 \(a multiple of 2\)"),
    ((2,) * 4, S.DUALPIPEV, 6, r"at least one per stage \(4\): use 8 \(a multiple of 2, "
                               r"at least 8\)"),
])
def test_copies_that_cannot_run_name_the_fix(replicas: tuple[int, ...], kind: S, per: int,
                                             message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        build_schedule(replicas, kind, per, per, virtual_stages=2)


def test_zero_3_is_refused_on_copies() -> None:
    build_schedule((2,) * 4, S.INTERLEAVED, 8, 4, virtual_stages=2, zero=(2,) * 4)
    with pytest.raises(ScheduleError, match="use zero <= 2, or virtual_stages=1"):
        build_schedule((2,) * 4, S.INTERLEAVED, 8, 4, virtual_stages=2, zero=(3, 0, 0, 0))

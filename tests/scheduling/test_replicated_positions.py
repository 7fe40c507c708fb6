"""Several stages a rank on positions replicated unevenly (interleaved 1F1B, zbv): each
position's replicas deal the unreplicated order's microbatches round-robin."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.errors import ScheduleError
from dreampipe.planning.placement import rank_stages, stage_rank
from dreampipe.scheduling.actions import ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule, forward_only
from dreampipe.scheduling.validator import validate_schedule
from dreampipe.simulation.action_costs import SimCosts
from dreampipe.simulation.simulator import simulate_schedule

K = ActionKind
S = ScheduleKind
_COMPUTE = (K.FORWARD, K.BACKWARD, K.WEIGHT)

#: (kind, each position's replicas, stages a rank, microbatches an update, updates, ZeRO)
_Case = tuple[S, tuple[int, ...], int, int, int, int]


@st.composite
def _positions(draw: st.DrawFn) -> _Case:
    kind = draw(st.sampled_from([S.INTERLEAVED, S.ZBV]))
    p = draw(st.integers(2, 3))
    counts = tuple(draw(st.lists(st.integers(1, 3), min_size=p, max_size=p)
                        .filter(lambda c: len(set(c)) > 1)))
    v = draw(st.integers(2, 3)) if kind is S.INTERLEAVED else 2
    unit = (p if kind is S.INTERLEAVED else 1) * math.lcm(*counts)
    return (kind, counts, v, unit * draw(st.integers(1, 2)), draw(st.integers(1, 2)),
            draw(st.sampled_from([0, 1, 2])))


def _replicas(kind: S, counts: tuple[int, ...], v: int) -> tuple[int, ...]:
    n = len(counts) * v
    return tuple(counts[stage_rank(s, n, v, kind.placement)] for s in range(n))


@settings(max_examples=40, deadline=None)
@given(_positions())
def test_each_replica_runs_its_share_of_the_positions_order_then_reduces(case: _Case) -> None:
    """Every microbatch ``u`` runs ``F`` then ``B`` (then ``W``) once on every stage, on
    replica ``u mod r_q`` of the stage's position ``q`` (ranks numbered position by
    position); each replica's order is the unreplicated order of the position, its own
    microbatches kept; it reduces each of its stages after its last ``B``/``W`` of the
    update and all of them before its first step; the validator accepts it and the
    simulator runs it to the end."""
    kind, counts, v, m, updates, zero = case
    replicas = _replicas(kind, counts, v)
    n = len(replicas)
    sched = build_schedule(replicas, kind, m * updates, m, virtual_stages=v,
                           zero=(zero,) * n)
    validate_schedule(sched)
    single = build_schedule((1,) * n, kind, m * updates, m, virtual_stages=v)
    firsts = [sum(counts[:q]) for q in range(len(counts))]
    assert sched.num_ranks == sum(counts)
    seen: dict[tuple[K, int, int], tuple[int, int]] = {}
    for rank, acts in enumerate(sched.actions):
        q = max(i for i, f in enumerate(firsts) if f <= rank)
        replica, r = rank - firsts[q], counts[q]
        assert sched.stages_of_rank(rank) == rank_stages(q, n, v, kind.placement)
        compute = [(a.kind, a.stage, a.microbatch) for a in acts if a.kind in _COMPUTE]
        assert compute == [(a.kind, a.stage, a.microbatch) for a in single.actions[q]
                           if a.kind in _COMPUTE and a.microbatch % r == replica]
        for i, (kind_, stage, u) in enumerate(compute):
            assert (kind_, stage, u) not in seen
            seen[kind_, stage, u] = (rank, i)
        for k in range(updates):
            steps = [i for i, a in enumerate(acts) if a.kind is K.STEP and a.microbatch == k]
            assert len(steps) == v
            for stage in sched.stages_of_rank(rank):
                last = max(i for i, a in enumerate(acts) if a.kind in _COMPUTE[1:]
                           and a.stage == stage and a.microbatch // m == k)
                reduce = [i for i, a in enumerate(acts) if a.kind is K.ALLREDUCE
                          and a.stage == stage and a.microbatch == k]
                assert len(reduce) == (r > 1)
                assert last < min(reduce + steps) and max(reduce, default=-1) < min(steps)
    wanted = (K.FORWARD, K.BACKWARD) + ((K.WEIGHT,) if kind.splits_backward else ())
    for stage in range(n):
        for u in range(m * updates):
            ranks = {seen[w, stage, u][0] for w in wanted}
            assert ranks == {sched.rank_of(stage, u)}
            assert sched.rank_of(stage, u) == firsts[stage_rank(stage, n, v, kind.placement)] \
                + u % replicas[stage]
            assert seen[K.FORWARD, stage, u][1] < seen[K.BACKWARD, stage, u][1]
    assert Schedule.from_text(sched.to_text()) == sched
    costs = SimCosts(forward_s=(1.0,) * n, backward_s=(2.0,) * n, weight_grad_s=(1.0,) * n)
    result = simulate_schedule(sched, costs)
    assert sum(result.busy_s) == pytest.approx(m * updates * n * 3.0)  # every action ran


def test_a_2_1_interleaving_on_3_ranks() -> None:
    """Stages 0 and 2 on ranks 0 and 1, stages 1 and 3 on rank 2: rank 0 runs the even
    microbatches of position 0's order, rank 1 the odd, rank 2 all of position 1's."""
    sched = build_schedule((2, 1, 2, 1), S.INTERLEAVED, 4, 4, virtual_stages=2)
    words = [" ".join(f"{a}@{a.stage}" for a in acts if a.kind in (K.FORWARD, K.BACKWARD))
             for acts in sched.actions]
    assert words == [
        "F0@0 F0@2 F2@0 B0@2 F2@2 B0@0 B2@2 B2@0",
        "F1@0 F1@2 F3@0 B1@2 F3@2 B1@0 B3@2 B3@0",
        "F0@1 F1@1 F0@3 B0@3 F1@3 B1@3 F2@1 B0@1 F3@1 B1@1 F2@3 B2@3 F3@3 B3@3 B2@1 B3@1"]
    assert [sched.stages_of_rank(r) for r in range(3)] == [(0, 2), (0, 2), (1, 3)]
    assert [sched.first_rank(s) for s in range(4)] == [0, 2, 0, 2]
    reduces = [[f"{a}@{a.stage}" for a in acts if a.kind is K.ALLREDUCE]
               for acts in sched.actions]
    assert reduces == [["ALLREDUCE0@0", "ALLREDUCE0@2"]] * 2 + [[]]
    evaluation = forward_only((2, 1, 2, 1), 4, virtual_stages=2, kind=S.INTERLEAVED)
    assert [[f"{a}@{a.stage}" for a in acts if a.kind is K.FORWARD]
            for acts in evaluation.actions] == [
        ["F0@0", "F2@0", "F0@2", "F2@2"], ["F1@0", "F3@0", "F1@2", "F3@2"],
        ["F0@1", "F1@1", "F2@1", "F3@1", "F0@3", "F1@3", "F2@3", "F3@3"]]


def test_zero_3_is_refused_on_a_replicated_position() -> None:
    build_schedule((2, 1, 2, 1), S.INTERLEAVED, 4, 4, virtual_stages=2, zero=(0, 3, 0, 3))
    with pytest.raises(ScheduleError, match="use zero <= 2, or virtual_stages=1"):
        build_schedule((2, 1, 2, 1), S.INTERLEAVED, 4, 4, virtual_stages=2, zero=(3, 0, 0, 0))

"""Interleaved 1F1B: placement, Megatron's order, the balanced plan, input errors."""

from __future__ import annotations

import itertools

import pytest

from dreampipe.errors import ScheduleError
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.scheduling.actions import ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.interleave import interleaved_plan, virtual_worker

K = ActionKind
S = ScheduleKind


def _words(text: str) -> list[str]:
    return text.split()


def test_stage_s_runs_on_worker_s_mod_workers() -> None:
    assert [virtual_worker(s, 8, 2) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    sched = build_schedule([1] * 8, S.INTERLEAVED, 8, 4, virtual_stages=2)
    assert sched.num_ranks == 4
    assert [sched.stages_of_rank(r) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    for rank, acts in enumerate(sched.actions):
        assert {a.stage for a in acts} == {rank, rank + 4}
    with pytest.raises(ScheduleError, match="divisor of 8"):
        virtual_worker(0, 8, 3)


def test_megatron_order_on_two_workers() -> None:
    sched = build_schedule([1] * 4, S.INTERLEAVED, 4, 4, virtual_stages=2)
    words = [f"{a}@{a.stage}" for a in sched.actions[0]
             if a.kind in (K.FORWARD, K.BACKWARD)]
    # worker 0 of 2: (2-0-1)*2 + (2-1)*2 = 4 forwards first, chunk 0 then chunk 1
    assert words == _words("F0@0 F1@0 F0@2 F1@2 F2@0 B0@2 F3@0 B1@2 F2@2 B0@0 F3@2 B1@0 "
                     "B2@2 B3@2 B2@0 B3@0")
    assert Schedule.from_text(sched.to_text()) == sched


def test_every_stage_steps_once_per_minibatch() -> None:
    sched = build_schedule([1] * 6, S.INTERLEAVED, 12, 6, virtual_stages=3)
    for rank, acts in enumerate(sched.actions):
        steps = [(a.stage, a.microbatch) for a in acts if a.kind is K.STEP]
        assert sorted(steps) == sorted((s, k) for s in (rank, rank + 2, rank + 4)
                                       for k in range(2))


@pytest.mark.parametrize(("replicas", "per", "virtual", "message"), [
    ((1,) * 8, 6, 2, "multiple of 4"),
    ((2, 1, 1, 1), 4, 2, "stage 2 shares position 0's ranks with stage 0, so it needs its 2 "
                         "replicas; give every stage of a position as many"),
    ((2, 1, 2, 1), 6, 2, r"2 positions of 2-1 replicas .* it needs a multiple of its 2 "
                         r"positions, each's share a multiple of 2, so that a position's "
                         r"replicas take equal shares round-robin: use 8 \(a multiple of 4\)"),
    ((2, 2, 2, 2), 6, 2, r"m / 2 of them, which must be a multiple of the 2 ranks a copy: "
                         r"use 8 \(a multiple of 4\)"),
    ((1,) * 4, 4, 2, None),
    ((1,) * 4, 4, 3, "divisor of 4"),
])
def test_interleaved_input_errors(replicas: tuple[int, ...], per: int, virtual: int,
                                  message: str | None) -> None:
    if message is None:
        build_schedule(replicas, S.INTERLEAVED, per, per, virtual_stages=virtual)
        with pytest.raises(ScheduleError, match="only interleaved-1f1b"):
            build_schedule(replicas, S.FLUSH, per, per, virtual_stages=virtual)
        return
    with pytest.raises(ScheduleError, match=message):
        build_schedule(replicas, S.INTERLEAVED, per, per, virtual_stages=virtual)


def test_interleaved_plan_balances_the_chain() -> None:
    times = [1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 1.0, 3.0]
    graph = LayerGraph.chain([Layer(f"l{i}", t / 3, 2 * t / 3, 10, 10)
                              for i, t in enumerate(times)])
    plan = interleaved_plan(graph, 2, 2)
    assert plan.num_stages == 4 and [st.ranks for st in plan.stages] == [(0,), (1,), (0,), (1,)]
    assert plan.virtual_stages == 2 and plan.workers_used == 2  # the plan says where they run
    # 12 ms in 4 pieces: the last layer alone is 3 ms, so 4 ms is the least largest piece
    assert max(st.compute_s for st in plan.stages) == pytest.approx(4e-3)
    assert sum(st.compute_s for st in plan.stages) == pytest.approx(12e-3)
    with pytest.raises(ScheduleError, match="at most one stage per layer"):
        interleaved_plan(graph, 4, 3)


def test_a_replicated_position_takes_its_replicas_share_of_the_layers() -> None:
    """Positions replicated 2-1 on 3 workers: the replicated position's stages run on
    ranks 0 and 1 and hold about twice the work of the others, each stage's work over its
    replicas balanced (brute force over the cuts)."""
    times = [1.0] * 12
    graph = LayerGraph.chain([Layer(f"l{i}", t / 3, 2 * t / 3, 10, 10)
                              for i, t in enumerate(times)])
    plan = interleaved_plan(graph, 3, 2, positions=[2, 1])
    assert [st.replicas for st in plan.stages] == [2, 1, 2, 1]
    assert [st.ranks for st in plan.stages] == [(0, 1), (2,), (0, 1), (2,)]
    assert plan.workers_used == 3 and plan.virtual_stages == 2
    per = [st.compute_s / st.replicas for st in plan.stages]
    best = min(max(a / 2, (b - a), (c - b) / 2, 12 - c)
               for a, b, c in itertools.combinations(range(1, 12), 3))
    assert max(per) == pytest.approx(best * 1e-3)
    assert [st.last - st.first + 1 for st in plan.stages] == [4, 2, 4, 2]
    with pytest.raises(ScheduleError, match="positions \\[2, 2\\] for 3 workers"):
        interleaved_plan(graph, 3, 2, positions=[2, 2])

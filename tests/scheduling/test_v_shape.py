"""The V schedules, zbv and dualpipev: PyTorch's orders on every size, two stages a rank in
a V, each microbatch's F before its B before its W, and a validator that refuses any move
that breaks what the V depends on."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    _Action,
    _ComputationType,
)

from dreampipe.errors import ScheduleError
from dreampipe.planning.placement import Placement, rank_stages, stage_rank, stage_ranks
from dreampipe.scheduling.actions import Action, ActionKind, Schedule
from dreampipe.scheduling.actions import ScheduleKind as S
from dreampipe.scheduling.build import build_schedule, compute_schedule
from dreampipe.scheduling.validator import validate_schedule

__all__: list[str] = []

_K = ActionKind
_T = _ComputationType


def _theirs(cls: Any, ranks: int, microbatches: int, rank: int) -> list[Action]:
    """PyTorch's order for ``rank``, its computations in dreampipe's words: ``I`` is ``B``,
    a whole backward ``B`` then its ``W``, an ``OVERLAP_F_B`` one action then its ``W``."""
    me = SimpleNamespace(pp_group_size=ranks, num_stages=2 * ranks,
                         _n_microbatches=microbatches)
    out: list[Action] = []

    def word(a: _Action) -> list[Action]:
        assert a.microbatch_index is not None
        u, s = a.microbatch_index, a.stage_index
        return {_T.FORWARD: [Action(_K.FORWARD, s, u)],
                _T.BACKWARD_INPUT: [Action(_K.BACKWARD, s, u)],
                _T.BACKWARD_WEIGHT: [Action(_K.WEIGHT, s, u)],
                _T.FULL_BACKWARD: [Action(_K.BACKWARD, s, u), Action(_K.WEIGHT, s, u)],
                }[a.computation_type]

    for a in cls._calculate_single_rank_operations(me, rank):
        if a is None:
            continue
        if a.computation_type is _T.OVERLAP_F_B:
            assert a.sub_actions is not None
            f, b = (word(x) for x in a.sub_actions)
            out += [Action.overlap(f[0], b[0]), *b[1:]]
        else:
            out += word(a)
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.sampled_from([S.ZBV, S.DUALPIPEV]))
def test_the_orders_are_pytorchs(ranks: int, microbatches: int, kind: S) -> None:
    """Every rank's computations, in order, are those PyTorch's ScheduleZBVZeroBubble and
    ScheduleDualPipeV run (DualPipeV takes at least one microbatch a stage)."""
    m = max(microbatches, 2 * ranks) if kind is S.DUALPIPEV else microbatches
    ours = compute_schedule([1] * (2 * ranks), kind, m, m, virtual_stages=2)
    cls = ScheduleZBVZeroBubble if kind is S.ZBV else ScheduleDualPipeV
    for rank in range(ranks):
        assert list(ours.actions[rank]) == _theirs(cls, ranks, m, rank), rank


def test_the_v_places_stage_s_with_2p_minus_1_minus_s() -> None:
    assert stage_ranks(8, 2, Placement.V) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert [rank_stages(r, 8, 2, Placement.V) for r in range(4)] == [
        (0, 7), (1, 6), (2, 5), (3, 4)]
    assert all(stage_rank(s, 8, 2, Placement.V) == r
               for r in range(4) for s in rank_stages(r, 8, 2, Placement.V))
    zbv = build_schedule([1] * 8, S.ZBV, 8, 8, virtual_stages=2)
    assert [zbv.stages_of_rank(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [zbv.rank_of(s, 0) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def _orders_hold(schedule: Schedule) -> bool:
    """Checked apart from the validator: on every rank, each (stage, microbatch) runs F,
    then B, then W, each once; each receive comes before what uses it and each send after
    what makes it; every stage on the rank the V gives it."""
    last = schedule.num_stages - 1
    for rank, acts in enumerate(schedule.actions):
        at: dict[tuple[ActionKind, int, int], int] = {}
        for step, whole in enumerate(acts):
            for a in whole.parts:
                if stage_rank(a.stage, schedule.num_stages, 2, Placement.V) != rank:
                    return False
                at.setdefault((a.kind, a.stage, a.microbatch), step)
        for (kind, s, u), step in at.items():
            need = {_K.BACKWARD: [(_K.FORWARD, s)] + ([(_K.RECV_B, s)] if s < last else []),
                    _K.WEIGHT: [(_K.BACKWARD, s)],
                    _K.FORWARD: [(_K.RECV_F, s)] if s > 0 else [],
                    _K.SEND_F: [(_K.FORWARD, s)], _K.SEND_B: [(_K.BACKWARD, s)]}.get(kind, [])
            for earlier, stage in need:
                before = at.get((earlier, stage, u))
                if before is None or before > step or (before == step and earlier not in (
                        _K.FORWARD,)):
                    return False
    return True


@st.composite
def _v_schedules(draw: st.DrawFn) -> Schedule:
    kind = draw(st.sampled_from([S.ZBV, S.DUALPIPEV]))
    ranks = draw(st.integers(1, 4))
    m = draw(st.integers(2 * ranks if kind is S.DUALPIPEV else 1, 10))
    updates = draw(st.integers(1, 2))
    return build_schedule([1] * (2 * ranks), kind, m * updates, m, virtual_stages=2)


@settings(max_examples=60, deadline=None)
@given(_v_schedules())
def test_every_built_v_schedule_keeps_each_microbatch_in_order(schedule: Schedule) -> None:
    """F before B before W per stage, data before use, the turn handed over on its rank."""
    validate_schedule(schedule)
    assert _orders_hold(schedule)
    p = schedule.num_ranks
    turns = [a for a in schedule.actions[p - 1] if a.kind is _K.SEND_F and a.stage == p - 1]
    assert turns and all(schedule.peer(p - 1, a) == p - 1 for a in turns)


@settings(max_examples=150, deadline=None)
@given(_v_schedules(), st.data())
def test_a_move_that_breaks_the_order_is_refused(schedule: Schedule, data: st.DataObject
                                                 ) -> None:
    """Any one action moved elsewhere on its rank: where that breaks an order the V
    depends on, the validator says so; what it accepts keeps every order."""
    rank = data.draw(st.integers(0, schedule.num_ranks - 1))
    acts = list(schedule.actions[rank])
    i = data.draw(st.integers(0, len(acts) - 1))
    j = data.draw(st.integers(0, len(acts) - 1))
    acts.insert(j, acts.pop(i))
    moved = schedule.with_actions([tuple(acts) if r == rank else a
                                   for r, a in enumerate(schedule.actions)])
    try:
        validate_schedule(moved)
    except ScheduleError:
        return
    assert _orders_hold(moved)


def test_an_overlapped_pair_is_checked_as_its_two_parts() -> None:
    dual = build_schedule([1] * 4, S.DUALPIPEV, 4, 4, virtual_stages=2)
    text = dual.to_text()
    assert "F3@0+B1@3" in text and Schedule.from_text(text) == dual
    # the pair first on its rank: its backward before the forward of its own microbatch
    acts = list(dual.actions[0])
    pair = next(a for a in acts if a.kind is _K.OVERLAP)
    acts.remove(pair)
    with pytest.raises(ScheduleError, match=r"rank 0 runs B1 at step 0 before F1 at step"):
        validate_schedule(dual.with_actions([(pair, *acts), dual.actions[1]]))
    # a pair whose backward is of a stage the rank does not hold
    with pytest.raises(ScheduleError, match=r"F3\+B1 at step \d+ is for stage 2; move it to "
                       r"a rank of stage 2"):
        validate_schedule(dual.with_actions([
            tuple(Action.overlap(*(p if p.kind is _K.FORWARD else Action(_K.BACKWARD, 2, 1)
                                   for p in a.parts)) if a.kind is _K.OVERLAP else a
                  for a in dual.actions[0]), dual.actions[1]]))


@pytest.mark.parametrize(("build", "message"), [
    (lambda: build_schedule([1] * 4, S.DUALPIPEV, 3, 3, virtual_stages=2),
     r"dualpipev with 3 microbatches per minibatch over 4 stages; .* give 4 or more"),
    (lambda: build_schedule([1] * 4, S.ZBV, 4, 4),
     r"zbv with virtual_stages=1; it runs 2 stages on each worker, in a V"),
    (lambda: build_schedule([1] * 6, S.ZBV, 4, 4, virtual_stages=3),
     r"zbv with virtual_stages=3"),
    (lambda: build_schedule([2, 1, 1, 1], S.ZBV, 4, 4, virtual_stages=2),
     r"replicas|virtual_stages=2 with replicas"),
])
def test_what_a_v_cannot_run_names_the_fix(build: Any, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        build()

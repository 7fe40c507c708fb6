"""Where a rank's run of actions stops and which receives it posts ahead: never past the
stop, at most ``LOOKAHEAD`` actions ahead, retried when the link cannot take one yet,
and resumed at the first receive not yet run on a new schedule."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.runtime.receives_ahead import LOOKAHEAD, ReceivesAhead
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule

__all__: list[str] = []

_RECVS = (ActionKind.RECV_F, ActionKind.RECV_B)


def _schedule(microbatches: int = 6) -> Schedule:
    return build_schedule([1, 1, 1], ScheduleKind.FLUSH, microbatches, microbatches)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2), st.integers(0, 6), st.integers(0, 30))
def test_a_run_stops_at_the_first_action_that_needs_a_microbatch_not_given(
        rank: int, given_: int, start: int) -> None:
    schedule = _schedule()
    receives = ReceivesAhead(schedule, rank, 0)
    actions = schedule.actions[rank]
    start = min(start, len(actions))
    end = receives.runnable_end(start, given_)
    assert all(schedule.last_microbatch(a) < given_ for a in actions[start:end])
    assert end == len(actions) or schedule.last_microbatch(actions[end]) >= given_
    assert receives.runnable_end(start, None) == len(actions)
    stop, post_stop = receives.stops(start, given_, None)
    assert stop == post_stop == end
    stop, post_stop = receives.stops(start, given_, given_ + 1)
    assert stop == end and post_stop == receives.runnable_end(end, given_ + 1)


def _rank(rank: int, done: int = 0) -> tuple[list[Action], list[int], ReceivesAhead]:
    """Rank ``rank``'s actions, where its receives are, and its receives ahead after the
    first ``done`` actions ran."""
    schedule = _schedule()
    actions = list(schedule.actions[rank])
    return (actions, [i for i, a in enumerate(actions) if a.kind in _RECVS],
            ReceivesAhead(schedule, rank, done))


def test_receives_are_posted_in_order_within_the_lookahead_and_before_the_stop() -> None:
    actions, recv_at, receives = _rank(1)
    posted: list[Action] = []
    stop = recv_at[3]  # the fourth receive is past the stop
    for i in range(stop):
        receives.post(i, stop, lambda a: posted.append(a) is None)
        assert all(actions.index(a) <= i + LOOKAHEAD for a in posted)
    assert posted == [actions[k] for k in recv_at[:3]]


def test_a_receive_the_link_cannot_take_is_tried_again_then_posted_once() -> None:
    actions, recv_at, receives = _rank(1)
    posted: list[Action] = []
    receives.post(0, len(actions), lambda a: False)
    receives.post(0, len(actions), lambda a: posted.append(a) is None)
    receives.post(0, len(actions), lambda a: posted.append(a) is None)
    ahead = [actions[k] for k in recv_at if k <= LOOKAHEAD]
    assert ahead and posted == ahead


def test_a_new_schedule_posts_from_the_first_receive_not_yet_run() -> None:
    _, recv_at, _ = _rank(2)
    done = recv_at[2] + 1  # three receives have run
    actions, _, receives = _rank(2, done)
    posted: list[Action] = []
    receives.post(done, len(actions), lambda a: posted.append(a) is None)
    assert posted and posted[0] is actions[recv_at[3]]

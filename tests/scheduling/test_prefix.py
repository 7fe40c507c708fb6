"""The prefix property incremental execution relies on (:meth:`RankRunner.advance`).

A schedule built for a long horizon, cut before the first action that needs
a microbatch beyond the ``n`` given, is a prefix of the schedule built for exactly
``n`` microbatches: a runtime can run the long one as data arrives and finish with
the exact one (its tail is the drain), on every rank and for every kind.
"""

from __future__ import annotations

import pytest

from dreampipe.scheduling.actions import Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule

__all__: list[str] = []

CASES = [
    (ScheduleKind.PIPEDREAM, (1, 1, 1, 1), 1),
    (ScheduleKind.PIPEDREAM, (2, 1), 1),
    (ScheduleKind.PIPEDREAM, (3, 2, 1), 1),
    (ScheduleKind.FLUSH, (1, 1, 1), 4),
    (ScheduleKind.FLUSH, (2, 1), 3),
    (ScheduleKind.GPIPE, (1, 2), 4),
    (ScheduleKind.DP, (3,), 6),
    (ScheduleKind.NAIVE, (1, 1, 1), 2),
    (ScheduleKind.ZB_H1, (1, 1, 1), 4),
    (ScheduleKind.ZB_H2, (2, 1), 4),
    (ScheduleKind.TWO_BW, (1, 1, 1), 2),
    (ScheduleKind.TWO_BW, (1, 2), 4),  # deferred steps
    (ScheduleKind.TWO_BW, (2, 1, 2), 8),
]


def _cut(schedule: Schedule, rank: int, given: int) -> tuple[object, ...]:
    acts = schedule.actions[rank]
    stop = next((i for i, a in enumerate(acts) if schedule.last_microbatch(a) >= given), len(acts))
    return acts[:stop]


@pytest.mark.parametrize(("kind", "replicas", "per"), CASES,
                         ids=[f"{c[0].value}-{'-'.join(map(str, c[1]))}" for c in CASES])
def test_long_schedule_cut_at_the_given_microbatches_is_a_prefix_of_the_exact_one(
    kind: ScheduleKind, replicas: tuple[int, ...], per: int
) -> None:
    horizon = build_schedule(replicas, kind, 40 * per, per)
    for n in range(1, 13):
        exact = build_schedule(replicas, kind, n * per, per)
        for rank in range(sum(replicas)):
            cut = _cut(horizon, rank, n * per)
            assert exact.actions[rank][: len(cut)] == cut, (kind, replicas, n, rank)
            if kind.synchronous:  # a synchronous minibatch is a whole update
                assert cut == exact.actions[rank]

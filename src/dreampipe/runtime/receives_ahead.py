"""Where a rank's run of actions stops, and its receives posted a few actions ahead of it.

:meth:`~dreampipe.runtime.engine.RankRunner.advance` runs a rank's actions up to
the first that needs a microbatch not given yet (``ALLREDUCE`` and ``STEP`` need
the last of their round), and posts the receives of the next :data:`LOOKAHEAD`
actions early, so that communication overlaps compute (:mod:`.comm`): never past
that stop or, where the backend allows it, past the stop of the microbatches about
to be given. On a new schedule posting resumes at the first receive not yet run;
one posted already (e.g. ahead of a switch) is found posted again. docs/design.md §8.4.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from dreampipe.scheduling.actions import Action, ActionKind, Schedule

__all__ = ["LOOKAHEAD", "ReceivesAhead"]

#: How many actions ahead of the one it runs a rank posts a receive.
LOOKAHEAD = 8
_RECVS = (ActionKind.RECV_F, ActionKind.RECV_B)


class ReceivesAhead:
    """``rank``'s actions of ``schedule``, the first ``done`` of them run already: where a
    run of them stops, and how many of their receives are posted."""

    def __init__(self, schedule: Schedule, rank: int, done: int) -> None:
        self.actions = schedule.actions[rank]
        self._need = schedule.last_microbatch
        self._recv_at = [i for i, a in enumerate(self.actions) if a.kind in _RECVS]
        self._posted = bisect.bisect_left(self._recv_at, done)

    def runnable_end(self, start: int, given: int | None) -> int:
        """The index of the first action from ``start`` on that needs a microbatch ``>= given``
        (``given`` None: the end)."""
        actions = self.actions
        if given is None:
            return len(actions)
        need, end = self._need, start
        while end < len(actions) and need(actions[end]) < given:
            end += 1
        return end

    def stops(self, start: int, given: int | None, post_until: int | None) -> tuple[int, int]:
        """Where a run from ``start`` stops (:meth:`runnable_end` of ``given``), and where its
        posting stops: there too, or with ``post_until`` the stop that it would give."""
        stop = self.runnable_end(start, given)
        return stop, stop if post_until is None else self.runnable_end(stop, post_until)

    def post(self, i: int, stop: int, post: Callable[[Action], bool]) -> None:
        """Before action ``i`` runs, post the receives up to :data:`LOOKAHEAD` actions ahead
        and before ``stop``, until ``post`` cannot post one yet (it is tried again later)."""
        recv_at = self._recv_at
        while (self._posted < len(recv_at) and recv_at[self._posted] <= i + LOOKAHEAD
               and recv_at[self._posted] < stop):
            if not post(self.actions[recv_at[self._posted]]):
                break
            self._posted += 1

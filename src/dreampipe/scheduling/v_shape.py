"""The V-shaped schedules: ZB-V (Qi et al., ICLR 2024) and DeepSeek's DualPipeV.

Both run ``2p`` stages on ``p`` ranks in the V placement: rank ``r`` holds stage
``r`` (chunk 0, on the way down) and ``2p - 1 - r`` (chunk 1, on the way back), so
the turn ``p - 1 -> p`` stays on rank ``p - 1``. Both split every backward into
``B`` and ``W`` as zb-h1 does. Per minibatch of ``m`` microbatches, rank ``r`` runs
(``F0`` a forward of chunk 0, ``B1W1`` a backward of chunk 1 and its ``W``):

- ``zbv``: ``2(p - r) - 1`` ``F0``; ``r`` times ``F1 F0``; ``p - r`` times
  ``F1 B1W1``; then ``F0 B0W0 F1 B1W1`` until every forward ran; ``r`` times
  ``B0 B1``, ``p - r`` times ``B0 W0``; the ``W`` left. Bubble-free in the steady
  state when ``F = B = W``; PyTorch's ``ScheduleZBVZeroBubble``'s order, over
  ``max(m, 2p - 1)`` microbatches, those past ``m`` left out.
- ``dualpipev``: DualPipeV's eight steps (PyTorch's ``ScheduleDualPipeV``), whose main
  step is ``F0&B1 F1&B0``: each an ``OVERLAP_F_B``, one microbatch's forward and
  another's backward in one action (docs/design.md §7.12). A whole backward is ``B``
  then its ``W``; a zero-bubble ``B`` puts ``W`` off, oldest first. ``m >= 2p``.
"""

from __future__ import annotations

from dreampipe.errors import ScheduleError
from dreampipe.planning.placement import Placement, rank_stages
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind

__all__ = ["v_shape_compute"]

_F, _B, _W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


def v_shape_compute(kind: ScheduleKind, num_stages: int, num_microbatches: int,
                    microbatches_per_update: int) -> Schedule:
    """Per-rank compute order of ``kind`` (zbv or dualpipev; module doc), unlowered."""
    p, m = num_stages // 2, microbatches_per_update
    if num_stages % 2 or p < 1:
        raise ScheduleError(f"{kind.value} with {num_stages} stages; it runs 2 stages on each "
                            "rank, in a V: give an even number of stages")
    if kind is ScheduleKind.DUALPIPEV and m < num_stages:
        raise ScheduleError(f"dualpipev with {m} microbatches per minibatch over {num_stages} "
                            f"stages; DualPipeV needs at least one per stage: give {num_stages} "
                            "or more")
    order = _zbv if kind is ScheduleKind.ZBV else _dualpipev
    actions = []
    for rank in range(p):
        down, up = rank_stages(rank, num_stages, 2, Placement.V)
        acts: list[Action] = []
        for first in range(0, num_microbatches, m):
            acts += order(_Rank(rank, p, down, up, first), m)
        actions.append(tuple(acts))
    return Schedule(kind, (1,) * num_stages, tuple(actions), num_microbatches, m, 2)


class _Rank:
    """One rank's minibatch being written: the next microbatch of each (kind, stage), and
    the weight gradients put off, oldest first."""

    def __init__(self, rank: int, ranks: int, down: int, up: int, first: int) -> None:
        self.rank, self.ranks, self.down, self.up, self.first = rank, ranks, down, up, first
        self.next: dict[tuple[ActionKind, int], int] = {}
        self.put_off: list[Action] = []
        self.out: list[Action] = []

    def take(self, kind: ActionKind, stage: int) -> Action:
        """The next microbatch's ``kind`` on ``stage``."""
        u = self.next.get((kind, stage), self.first)
        self.next[kind, stage] = u + 1
        return Action(kind, stage, u)

    def add(self, kind: ActionKind, stage: int) -> None:
        self.out.append(self.take(kind, stage))

    def repeat(self, times: int, *steps: tuple[ActionKind, int]) -> None:
        """``steps`` (each a kind and a stage) in turn, ``times`` times."""
        for _ in range(times):
            for kind, stage in steps:
                self.add(kind, stage)

    def whole_backward(self, stage: int) -> None:
        """``B`` and its ``W`` at once (DualPipeV's whole backward)."""
        b = self.take(_B, stage)
        self.out += [b, Action(_W, stage, b.microbatch)]

    def split_backward(self, stage: int) -> None:
        """``B`` now, its ``W`` put off (zero bubble)."""
        b = self.take(_B, stage)
        self.out.append(b)
        self.put_off.append(Action(_W, stage, b.microbatch))

    def weight(self) -> None:
        """The oldest ``W`` put off, if any."""
        if self.put_off:
            self.out.append(self.put_off.pop(0))

    def overlapped(self, forward: int, backward: int) -> None:
        """DualPipeV's ``F&B``: a forward of ``forward`` with a whole backward of ``backward``."""
        f, b = self.take(_F, forward), self.take(_B, backward)
        self.out += [Action.overlap(f, b), Action(_W, backward, b.microbatch)]


def _zbv(at: _Rank, m: int) -> list[Action]:
    """ZB-V's order over ``max(m, 2p - 1)`` microbatches, those past ``m`` left out."""
    r, p, down, up = at.rank, at.ranks, at.down, at.up
    n = max(m, 2 * p - 1)
    at.repeat(2 * (p - r) - 1, (_F, down))
    at.repeat(r, (_F, up), (_F, down))
    at.repeat(p - r, (_F, up), (_B, up), (_W, up))
    while at.next[_F, up] < at.next[_F, down] or at.next[_F, down] < at.first + n:
        if at.next[_F, down] < at.first + n:
            at.add(_F, down)
        at.repeat(1, (_B, down), (_W, down), (_F, up), (_B, up), (_W, up))
    at.repeat(r, (_B, down), (_B, up))
    at.repeat(p - r, (_B, down), (_W, down))
    for stage in (up, down):
        while at.next.get((_W, stage), at.first) < at.next[_B, stage]:
            at.add(_W, stage)
    return [a for a in at.out if a.microbatch < at.first + m]


def _dualpipev(at: _Rank, m: int) -> list[Action]:
    """DualPipeV's eight steps (module doc)."""
    r, p, down, up = at.rank, at.ranks, at.down, at.up
    at.repeat(2 * (p - r - 1), (_F, down))  # 1: F0
    at.repeat(r + 1, (_F, down), (_F, up))  # 2: F0 F1
    for _ in range(p - r - 1):  # 3: B1 W1 F1, zero bubble
        at.split_backward(up)
        at.weight()
        at.add(_F, up)
    for i in range(m - 2 * p + r + 1):  # 4, the main step: F0&B1 F1&B0
        if i == 0 and r == p - 1:  # the turn's rank: apart, for a smaller bubble
            at.add(_F, down)
            at.whole_backward(up)
        else:
            at.overlapped(down, up)
        at.overlapped(up, down)
    for _ in range(p - r - 1):  # 5: B1 F1&B0
        at.whole_backward(up)
        at.overlapped(up, down)
    split = False
    for i in range(r + 1):  # 6: B1 B0, zero bubble from the middle on
        for stage, parity in ((up, 1), (down, 0)):
            split = split or (i == (r + 1) // 2 and r % 2 == parity)
            (at.split_backward if split else at.whole_backward)(stage)
    for _ in range(p - r - 1):  # 7: W0 B0
        at.weight()
        at.split_backward(down)
    for _ in range(r + 1):  # 8: W0
        at.weight()
    return at.out

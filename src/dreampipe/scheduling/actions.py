"""Actions and schedules as plain data: what each rank does, in order.

An :class:`Action` is ``(kind, stage, unit)``; ``unit`` is the minibatch
number for PipeDream's asynchronous schedule and the global microbatch
number for the synchronous ones (microbatch ``u`` belongs to update
``u // units_per_update``). ``ALLREDUCE`` and ``STEP`` carry the minibatch
that triggers them: the minibatch itself in PipeDream's schedule, the update
number ``k`` (the k-th minibatch of microbatches) in the synchronous ones.
Its text form is short and parses back::

    F3  B3  SEND_F3  RECV_F3  SEND_B3  RECV_B3  ALLREDUCE3  STEP3

The stage is implied by the rank that runs the action; ``Schedule.to_text``
writes one line per rank and ``Schedule.from_text`` reads it back. Peers are
derived, never stored: unit ``u`` of stage ``s`` runs on replica
``u mod replicas[s]`` (1F1B-RR), so ``SEND_F3`` at stage 1 goes to the rank of
stage 2 that owns unit 3.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from enum import Enum

from dreampipe.errors import ScheduleError

__all__ = ["Action", "ActionKind", "Schedule", "ScheduleKind"]


class ActionKind(Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALLREDUCE = "ALLREDUCE"
    STEP = "STEP"

    # Members are singletons: identity hashing is correct and much faster than
    # Enum's default, which matters for schedules of millions of actions.
    __hash__ = object.__hash__


class ScheduleKind(Enum):
    PIPEDREAM = "pipedream"
    FLUSH = "1f1b-flush"
    GPIPE = "gpipe"
    DP = "dp"
    NAIVE = "naive"


_HEADER = re.compile(r"^# (\S+) replicas=([\d-]+) units=(\d+) per_update=(\d+)$")
_ACTION = re.compile(r"^(SEND_F|RECV_F|SEND_B|RECV_B|ALLREDUCE|STEP|F|B)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    kind: ActionKind
    stage: int
    unit: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.unit}"

    @classmethod
    def parse(cls, text: str, stage: int) -> Action:
        m = _ACTION.match(text.strip())
        if not m:
            raise ScheduleError(
                f"{text!r} is not an action; write e.g. F3, B3, SEND_F3, RECV_B3, ALLREDUCE3, STEP3"
            )
        return cls(ActionKind(m.group(1)), stage, int(m.group(2)))


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists, plus the layout needed to find peers.

    ``replicas[s]`` is stage s's replica count; ranks are numbered stage by
    stage as in :class:`dreampipe.planning.plan.Plan`. ``num_units`` units are run in
    all, ``units_per_update`` of them between optimizer steps (1 for
    PipeDream's per-minibatch updates).
    """

    kind: ScheduleKind
    replicas: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    num_units: int
    units_per_update: int = 1
    _firsts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.actions) != sum(self.replicas):
            raise ScheduleError(
                f"{len(self.actions)} action lists for {sum(self.replicas)} ranks "
                f"(replicas {list(self.replicas)})"
            )
        firsts = [0]
        for r in self.replicas:
            firsts.append(firsts[-1] + r)
        object.__setattr__(self, "_firsts", tuple(firsts))

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def stage_of_rank(self, rank: int) -> int:
        if not 0 <= rank < self.num_ranks:
            raise ScheduleError(f"rank {rank} is outside 0..{self.num_ranks - 1}")
        return bisect.bisect_right(self._firsts, rank) - 1

    def first_rank(self, stage: int) -> int:
        return self._firsts[stage]

    def replica_of_rank(self, rank: int) -> int:
        return rank - self.first_rank(self.stage_of_rank(rank))

    def rank_of(self, stage: int, unit: int) -> int:
        """The rank of ``stage`` that runs ``unit`` (round-robin over replicas)."""
        return self._firsts[stage] + unit % self.replicas[stage]

    def peer(self, rank: int, action: Action) -> int | None:
        """The rank a send/receive talks to; None for other kinds."""
        k = action.kind
        if k in (ActionKind.SEND_F, ActionKind.RECV_B):
            return self.rank_of(action.stage + 1, action.unit)
        if k in (ActionKind.RECV_F, ActionKind.SEND_B):
            return self.rank_of(action.stage - 1, action.unit)
        return None

    def allreduce_round(self, action: Action) -> int:
        """Which all-reduce of its stage ``action`` (an ALLREDUCE) joins.

        The replicas of a stage all-reduce together when their rounds agree.
        PipeDream's schedule all-reduces after every round of ``r`` minibatches
        (``ALLREDUCE<u>`` on each replica, round ``u // r``); the synchronous
        schedules number their all-reduces by update, ``ALLREDUCE<k>`` for the
        k-th minibatch, so the round is ``k``.
        """
        if self.kind is ScheduleKind.PIPEDREAM:
            return action.unit // self.replicas[action.stage]
        return action.unit

    def to_text(self) -> str:
        lines = [f"# {self.kind.value} replicas={'-'.join(map(str, self.replicas))} "
                 f"units={self.num_units} per_update={self.units_per_update}"]
        for rank, acts in enumerate(self.actions):
            lines.append(f"{rank}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        rows = [ln for ln in text.splitlines() if ln.strip()]
        m = _HEADER.match(rows[0] if rows else "")
        if not m:
            raise ScheduleError(
                "schedule text must start with '# KIND replicas=.. units=.. per_update=..'"
            )
        try:
            kind = ScheduleKind(m.group(1))
        except ValueError:
            valid = ", ".join(k.value for k in ScheduleKind)
            raise ScheduleError(f"unknown schedule {m.group(1)!r}; use one of {valid}") from None
        replicas = tuple(int(x) for x in m.group(2).split("-"))
        probe = cls(kind, replicas, tuple(() for _ in range(sum(replicas))), 0)
        actions = []
        for rank, row in enumerate(rows[1:]):
            head, _, body = row.partition(":")
            if head.strip() != str(rank):
                raise ScheduleError(f"line for rank {rank} starts with {head!r}")
            stage = probe.stage_of_rank(rank)
            actions.append(tuple(Action.parse(t, stage) for t in body.split()))
        return cls(kind, replicas, tuple(actions), int(m.group(3)), int(m.group(4)))

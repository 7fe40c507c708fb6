"""Actions and schedules as plain data: what each rank does, and what that means.

An :class:`Action` is ``(kind, stage, number)``. For ``F``/``B``/``W`` and the
sends and receives the number is the microbatch (a minibatch under PipeDream's
schedule, a microbatch under the others); for ``ALLREDUCE`` and ``STEP`` it is
the update ``k``: a rank's k-th weight update, and the all-reduce round its
stage's replicas join together; ``UNSHARD`` and ``RESHARD`` (torch's names) carry it too:
where a ZeRO-3 stage all-gathers its weights for update ``k``'s computations and where it
frees them again (:mod:`dreampipe.scheduling.unshard`). ``W`` is the weight gradient
of Zero Bubble's split backward; elsewhere ``B`` computes both gradients. Peers are derived,
never stored: microbatch ``u`` of stage ``s`` runs on replica ``u mod replicas[s]``
(1F1B-RR). :meth:`Schedule.to_text` writes one line per rank and
:meth:`Schedule.from_text` reads it back. What each action means, for the
validator, the simulator and the runtime alike, is docs/design.md §8.1-§8.2;
:mod:`dreampipe.scheduling.stepping` runs ranks by those rules. ``OVERLAP_F_B``
(DualPipeV's overlapped pair) is one action of two computations, a forward and
another microbatch's backward, which :attr:`Action.parts` names.
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from dreampipe.errors import ScheduleError
from dreampipe.planning.placement import (
    Placement,
    position_firsts,
    rank_stages,
    stage_rank,
    stray_stage,
)
from dreampipe.scheduling.formats import codec

__all__ = ["Action", "ActionKind", "Schedule", "ScheduleKind", "TransferKey", "rank_firsts"]

#: ``(0 activations / 1 gradients, sending stage, microbatch)``: equal for a send
#: and the receive it pairs with.
TransferKey = tuple[int, int, int]


class ActionKind(Enum):
    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALLREDUCE = "ALLREDUCE"
    STEP = "STEP"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    OVERLAP = "OVERLAP_F_B"

    # Members are singletons: identity hashing is correct and much faster than
    # Enum's default, which matters for schedules of millions of actions.
    __hash__ = object.__hash__


class ScheduleKind(Enum):
    PIPEDREAM = "pipedream"
    FLUSH = "1f1b-flush"
    GPIPE = "gpipe"
    DP = "dp"
    NAIVE = "naive"
    ZB_H1 = "zb-h1"
    ZB_H2 = "zb-h2"
    INTERLEAVED = "interleaved-1f1b"
    TWO_BW = "2bw"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs each weight gradient as its own ``W`` action."""
        return self in (ScheduleKind.ZB_H1, ScheduleKind.ZB_H2, ScheduleKind.ZBV,
                        ScheduleKind.DUALPIPEV)

    @property
    def placement(self) -> Placement:
        """Where its stages go when a rank runs several: the V for zbv and dualpipev (2 a
        rank), else the loop (:mod:`dreampipe.planning.placement`)."""
        return Placement.V if self in (ScheduleKind.ZBV, ScheduleKind.DUALPIPEV) else \
            Placement.LOOP

    @property
    def synchronous(self) -> bool:
        """Whether every update's gradients come from the weights of the update
        before it (one process's semantics); pipedream and 2bw train on stale
        weights."""
        return self not in (ScheduleKind.PIPEDREAM, ScheduleKind.TWO_BW)


_K = ActionKind
# kind -> (1 if gradient, offset to the sending stage, offset to the peer stage)
_TRANSFER = {
    _K.SEND_F: (0, 0, 1),
    _K.RECV_F: (0, -1, -1),
    _K.SEND_B: (1, 0, -1),
    _K.RECV_B: (1, 1, 1),
}
_SENDS = frozenset((_K.SEND_F, _K.SEND_B))
# numbered by update, not by microbatch
_PER_UPDATE = frozenset((_K.ALLREDUCE, _K.STEP, _K.UNSHARD, _K.RESHARD))

_HEADER = re.compile(
    r"^# (\S+) replicas=([\d-]+) (?:microbatches|units)=(\d+) per_update=(\d+)"
    r"(?: virtual=(\d+))?$")  # "units=": the word of older schedule files
_ACTION = re.compile(
    r"^(SEND_F|RECV_F|SEND_B|RECV_B|ALLREDUCE|STEP|UNSHARD|RESHARD|F|B|W)(\d+)$")
_OVERLAP = re.compile(r"^F(\d+)\+B(\d+)$")


@dataclass(frozen=True, order=True, slots=True)
class Action:
    """``kind`` of ``stage`` on ``microbatch``; an ``OVERLAP_F_B`` is the forward of
    ``stage`` on ``microbatch`` with the backward of ``backward_stage`` on
    ``backward_microbatch`` (-1 for every other kind)."""

    kind: ActionKind
    stage: int
    microbatch: int
    backward_stage: int = -1
    backward_microbatch: int = -1

    def __str__(self) -> str:
        if self.kind is _K.OVERLAP:
            return f"F{self.microbatch}+B{self.backward_microbatch}"
        return f"{self.kind.value}{self.microbatch}"

    @classmethod
    def overlap(cls, forward: Action, backward: Action) -> Action:
        """The ``OVERLAP_F_B`` that runs ``forward`` (an ``F``) and ``backward`` (a ``B``)."""
        if forward.kind is not _K.FORWARD or backward.kind is not _K.BACKWARD:
            raise ScheduleError(f"an overlapped pair is a forward and a backward, not "
                                f"{forward} and {backward}")
        return cls(_K.OVERLAP, forward.stage, forward.microbatch, backward.stage,
                   backward.microbatch)

    @property
    def parts(self) -> tuple[Action, ...]:
        """The computations this action runs: its two halves for ``OVERLAP_F_B`` (forward
        first), else itself."""
        if self.kind is not _K.OVERLAP:
            return (self,)
        return (Action(_K.FORWARD, self.stage, self.microbatch),
                Action(_K.BACKWARD, self.backward_stage, self.backward_microbatch))

    def shifted(self, microbatches: int, updates: int) -> Action:
        """This action ``microbatches`` microbatches on, or ``updates`` updates for
        ``ALLREDUCE``/``STEP``/``UNSHARD``/``RESHARD``."""
        if self.kind is _K.OVERLAP:
            return Action(self.kind, self.stage, self.microbatch + microbatches,
                          self.backward_stage, self.backward_microbatch + microbatches)
        return Action(self.kind, self.stage,
                      self.microbatch + (updates if self.kind in _PER_UPDATE else microbatches))

    @property
    def is_send(self) -> bool:
        """A send: posted without waiting (``isend``)."""
        return self.kind in _SENDS

    @property
    def transfer_key(self) -> TransferKey | None:
        """``(1 if gradient else 0, sending stage, microbatch)`` of a send or receive, else None.

        A send and the receive it pairs with share the key; both ends sit on
        ``Schedule.rank_of(stage, microbatch)`` of their stage.
        """
        info = _TRANSFER.get(self.kind)
        return None if info is None else (info[0], self.stage + info[1], self.microbatch)

    @property
    def peer_stage(self) -> int | None:
        """The stage a send or receive talks to (one up or down); None for other kinds."""
        info = _TRANSFER.get(self.kind)
        return None if info is None else self.stage + info[2]

    @property
    def allreduce_round(self) -> int:
        """The round an ``ALLREDUCE`` joins with its stage's replicas: its number,
        the update number, in every schedule."""
        if self.kind is not _K.ALLREDUCE:
            raise ScheduleError(f"{self} joins no all-reduce round; ask an ALLREDUCE action")
        return self.microbatch

    @classmethod
    def parse(cls, text: str, stage: int, backward_stage: int | None = None) -> Action:
        """The action ``text`` names on ``stage``; an overlapped pair ``F3+B1`` runs its
        backward on ``backward_stage`` (None: ``stage``)."""
        pair = _OVERLAP.match(text.strip())
        if pair:
            return cls(_K.OVERLAP, stage, int(pair.group(1)),
                       stage if backward_stage is None else backward_stage, int(pair.group(2)))
        m = _ACTION.match(text.strip())
        if not m:
            raise ScheduleError(
                f"{text!r} is not an action; write e.g. F3, B3, W3, SEND_F3, RECV_B3, "
                "ALLREDUCE3, STEP3, UNSHARD3, RESHARD3, or F3+B1 (an overlapped pair)"
            )
        return cls(ActionKind(m.group(1)), stage, int(m.group(2)))


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists, plus the layout needed to find peers.

    ``replicas[s]`` is stage s's replica count; ranks are numbered stage by
    stage as in :class:`dreampipe.planning.plan.Plan`. ``num_microbatches`` microbatches are run in
    all, ``microbatches_per_update`` of them between optimizer steps (1 for
    PipeDream's per-minibatch updates). ``virtual_stages`` > 1 puts that
    many stages on each rank, placed as the kind says
    (:attr:`ScheduleKind.placement`: interleaved 1F1B's loop, docs/design.md §7.7, or
    the V of zbv and dualpipev, §7.12) on ``p`` positions; every stage of position ``q``
    has its ``r_q`` replicas, and ranks are numbered position by position, a position's
    replicas side by side as a stage's are (``q * r + j`` when every ``r_q`` is ``r``:
    ``r`` copies of a ``p``-rank pipeline).
    """

    kind: ScheduleKind
    replicas: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    num_microbatches: int
    microbatches_per_update: int = 1
    virtual_stages: int = 1
    _firsts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        firsts = rank_firsts(self.kind, self.replicas, self.virtual_stages)
        if len(self.actions) != firsts[-1]:
            raise ScheduleError(
                f"{len(self.actions)} action lists for {firsts[-1]} ranks "
                f"(replicas {list(self.replicas)}, {self.virtual_stages} stages per rank)"
            )
        object.__setattr__(self, "_firsts", firsts)

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def placement(self) -> Placement:
        """Where the stages go when a rank runs several: the kind's."""
        return self.kind.placement

    def stage_of_rank(self, rank: int) -> int:
        """The stage ``rank`` runs: its first under interleaving (:meth:`stages_of_rank`)."""
        if not 0 <= rank < self.num_ranks:
            raise ScheduleError(f"rank {rank} is outside 0..{self.num_ranks - 1}")
        return bisect.bisect_right(self._firsts, rank) - 1  # a position's first stage: q

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """Every stage ``rank`` runs, in pipeline order: one, or ``virtual_stages``."""
        first = self.stage_of_rank(rank)
        return rank_stages(first, self.num_stages, self.virtual_stages, self.placement) if (
            self.virtual_stages > 1) else (first,)

    def first_rank(self, stage: int) -> int:
        if self.virtual_stages > 1:
            return self._firsts[stage_rank(stage, self.num_stages, self.virtual_stages,
                                           self.placement)]
        return self._firsts[stage]

    def replica_of_rank(self, rank: int) -> int:
        return rank - self.first_rank(self.stage_of_rank(rank))

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank of ``stage`` that runs ``microbatch`` (round-robin over replicas)."""
        return self.first_rank(stage) + microbatch % self.replicas[stage]

    def last_microbatch(self, action: Action) -> int:
        """The last microbatch whose data ``action`` needs: its own, or its round's last.

        An update (``ALLREDUCE``/``STEP``/``UNSHARD``/``RESHARD`` k) needs every
        microbatch of its round: the
        ``replicas`` microbatches of round k (PipeDream), or update k's microbatches.
        A runtime fed one minibatch at a time stops before the first action that
        needs a microbatch not yet given.
        """
        if action.kind is _K.OVERLAP:
            return max(action.microbatch, action.backward_microbatch)
        if action.kind not in _PER_UPDATE:
            return action.microbatch
        return (action.microbatch + 1) * self.round_microbatches(action.stage) - 1

    def round_microbatches(self, stage: int) -> int:
        """Microbatches in one update of ``stage``: its replicas' round (PipeDream), or the
        update's microbatches."""
        return (self.replicas[stage] if self.kind is ScheduleKind.PIPEDREAM
                else self.microbatches_per_update)

    def peer(self, rank: int, action: Action) -> int | None:
        """The rank a send/receive talks to; None for other kinds."""
        stage = action.peer_stage
        return None if stage is None else self.rank_of(stage, action.microbatch)

    def with_actions(self, actions: Sequence[tuple[Action, ...]]) -> Schedule:
        """This schedule with other action lists (a lowering pass's result)."""
        return Schedule(self.kind, self.replicas, tuple(actions), self.num_microbatches,
                        self.microbatches_per_update, self.virtual_stages)

    def to_text(self) -> str:
        lines = [f"# {self.kind.value} replicas={'-'.join(map(str, self.replicas))} "
                 f"microbatches={self.num_microbatches} per_update={self.microbatches_per_update}"
                 + (f" virtual={self.virtual_stages}" if self.virtual_stages > 1 else "")]
        at = self.virtual_stages > 1
        for rank, acts in enumerate(self.actions):
            lines.append(f"{rank}: " + " ".join(_written(a, at) for a in acts))
        return "\n".join(lines)

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        rows = [ln for ln in text.splitlines() if ln.strip()]
        m = _HEADER.match(rows[0] if rows else "")
        if not m:
            raise ScheduleError(
                "schedule text must start with '# KIND replicas=.. microbatches=.. per_update=..'"
            )
        try:
            kind = ScheduleKind(m.group(1))
        except ValueError:
            valid = ", ".join(k.value for k in ScheduleKind)
            raise ScheduleError(f"unknown schedule {m.group(1)!r}; use one of {valid}") from None
        replicas = tuple(int(x) for x in m.group(2).split("-"))
        virtual = int(m.group(5) or 1)
        probe = cls(kind, replicas, tuple(() for _ in range(
            rank_firsts(kind, replicas, virtual)[-1])), 0, virtual_stages=virtual)
        actions = []
        for rank, row in enumerate(rows[1:]):
            head, _, body = row.partition(":")
            if head.strip() != str(rank):
                raise ScheduleError(f"line for rank {rank} starts with {head!r}")
            actions.append(tuple(_parse_on(probe, rank, t) for t in body.split()))
        return cls(kind, replicas, tuple(actions), int(m.group(3)), int(m.group(4)), virtual)

    @classmethod
    def from_torch_csv(cls, path: str | os.PathLike[str], kind: ScheduleKind | None = None
                       ) -> Schedule:
        """The validated schedule of one update in PyTorch pipelining's CSV file at ``path``
        (``_dump_csv``'s, either format): :func:`~dreampipe.scheduling.torch_csv.read_torch_csv`."""
        read, _ = codec("torch-csv")
        schedule: Schedule = read(path, kind)
        return schedule

    def to_torch_csv(self, path: str | os.PathLike[str], comms: bool = True) -> None:
        """Write this schedule of one update as PyTorch pipelining's CSV, for its
        ``_load_csv``: :func:`~dreampipe.scheduling.torch_csv_write.write_torch_csv`."""
        _, write = codec("torch-csv")
        write(self, path, comms)


def rank_firsts(kind: ScheduleKind, replicas: tuple[int, ...], v: int) -> tuple[int, ...]:
    """The first rank of each stage (``v = 1``) or position (``v > 1``), then the ranks;
    a ScheduleError where ``v`` does not fit the stages or a position's stages disagree."""
    if v < 1 or (v > 1 and len(replicas) % v):
        raise ScheduleError(f"virtual_stages={v} with replicas {list(replicas)}; give a "
                            "count >= 1 that divides the stages")
    if kind.placement is Placement.V and v != 2:
        raise ScheduleError(f"{kind.value} with virtual_stages={v}; it runs 2 stages on each "
                            "rank, in a V: give virtual_stages=2")
    stray = stray_stage(replicas, v, kind.placement)
    if stray is not None:
        q = stage_rank(stray, len(replicas), v, kind.placement)
        raise ScheduleError(
            f"virtual_stages={v} with replicas {list(replicas)}: stage {stray} shares "
            f"position {q}'s ranks with stage {q}, so it needs its {replicas[q]} replicas; "
            "give every stage of a position as many")
    return position_firsts(replicas, v, kind.placement)


def _written(a: Action, at: bool) -> str:
    """``a`` in a line of :meth:`Schedule.to_text`: ``F3@5`` where ranks run several stages,
    an overlapped pair ``F3@1+B0@2``."""
    if not at:
        return str(a)
    return "+".join(f"{part}@{part.stage}" for part in a.parts)


def _parse_on(probe: Schedule, rank: int, text: str) -> Action:
    """An action of ``rank``'s line; where ranks run several stages written ``F3@5``
    (stage 5), an overlapped pair ``F3@1+B0@2``."""
    halves = text.split("+")
    if len(halves) == 2 and "@" in text:
        forward, backward = (_parse_on(probe, rank, h) for h in halves)
        return Action.overlap(forward, backward)
    word, _, stage = text.partition("@")
    if not stage:
        return Action.parse(word, probe.stage_of_rank(rank))
    if not stage.isdigit() or int(stage) not in probe.stages_of_rank(rank):
        raise ScheduleError(f"{text!r} on rank {rank}: name one of its stages "
                            f"{list(probe.stages_of_rank(rank))} after '@'")
    return Action.parse(word, int(stage))

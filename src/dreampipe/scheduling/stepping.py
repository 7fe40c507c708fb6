"""The one stepping core: run every rank through its action list as the runtime would.

Each rank executes its list in order. Compute and sends never wait; a receive waits
until the send of the same :attr:`~Action.transfer_key` has been posted; an
all-reduce, and a ZeRO-3 stage's ``UNSHARD`` (an all-gather), waits until every
replica of its stage has joined the same round (one a deferred ``STEP`` leaves in
flight, :func:`~dreampipe.scheduling.updates.launched_rounds`, joins without waiting
and its ``STEP`` waits instead); a ``RESHARD`` never waits (docs/design.md §8.2). With
``agree_steps`` a rank's first ``STEP`` of each update also waits for every rank's
(the runtime's agreement before an update: :mod:`dreampipe.runtime.update_actions`),
matched by their order on each rank, as collectives are. A blocked rank is parked
under what it waits for and woken when that happens. The validator's dry run uses
:class:`Stepper` as it is (every action takes no time; ranks left blocked are a
deadlock). The simulator subclasses it and overrides the hooks (:meth:`~Stepper.compute`,
:meth:`~Stepper.send`, :meth:`~Stepper.receive`, :meth:`~Stepper.allreduce`,
:meth:`~Stepper.launch`, :meth:`~Stepper.gather`, :meth:`~Stepper.release`,
:meth:`~Stepper.joined`) to put times on the same steps: each rank carries a clock
that the hooks advance, and transfers and all-reduces carry a ``(start, end)`` span.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from dreampipe.scheduling.actions import Action, ActionKind, Schedule, TransferKey
from dreampipe.scheduling.updates import launched_rounds

__all__ = ["Span", "Stepper"]

#: ``(start, end)`` of a transfer or an all-reduce, in seconds.
Span = tuple[float, float]

# Module constants: an Enum member looked up on its class costs more than
# the rest of a step (Python 3.11).
_F, _B, _W, _STEP = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT, ActionKind.STEP
_OVERLAP = ActionKind.OVERLAP
_SEND_F, _SEND_B = ActionKind.SEND_F, ActionKind.SEND_B
_UNSHARD, _RESHARD = ActionKind.UNSHARD, ActionKind.RESHARD
_RECV_F, _RECV_B = ActionKind.RECV_F, ActionKind.RECV_B
_ALLREDUCE = ActionKind.ALLREDUCE
_NOTHING: Span = (0.0, 0.0)


class Stepper:
    """Advances the ranks of ``schedule`` until none can move; hooks add timing.

    ``position[r]`` is the index of rank r's next action and ``clock[r]`` its
    time there (kept current whenever the rank blocks, and before
    :meth:`allreduce` reads it).
    """

    def __init__(self, schedule: Schedule, agree_steps: bool = False) -> None:
        self.schedule = schedule
        self.agree_steps = agree_steps
        #: per rank: the agreements it has made and the microbatch of its last one
        self._agreements = [0] * schedule.num_ranks
        self._agreed_on: list[int | None] = [None] * schedule.num_ranks
        self.position = [0] * schedule.num_ranks
        self.clock = [0.0] * schedule.num_ranks
        self._posted: dict[TransferKey, Span] = {}
        self._parked: dict[TransferKey | tuple[int, int], list[int]] = {}
        self._joined: dict[tuple[int, int], list[int]] = {}
        self._rounds: dict[tuple[int, int], Span] = {}
        #: per rank, the all-reduces its deferred steps leave in flight
        self._launched = [launched_rounds(acts) for acts in schedule.actions]

    def run(self) -> list[int]:
        """Step until no rank can move; the ranks left blocked (empty: all finished)."""
        ready = list(range(self.schedule.num_ranks))
        while ready:
            self._advance(ready.pop(), ready)
        return self.blocked()

    def blocked(self) -> list[int]:
        """The ranks with actions left (after :meth:`run`: those that could not move)."""
        acts = self.schedule.actions
        return [r for r, i in enumerate(self.position) if i < len(acts[r])]

    # ---- hooks: zero time by default -----------------------------------------
    def compute(self, rank: int, action: Action, clock: float) -> float:
        """Run ``F``/``B``/``W``/``STEP`` (or an ``OVERLAP_F_B``'s two parts) starting at
        ``clock``; the clock after it."""
        return clock

    def send(self, rank: int, action: Action, clock: float) -> tuple[float, Span]:
        """Post a send at ``clock``; the sender's clock after posting, and the
        span of the transfer (what its receive waits for)."""
        return clock, _NOTHING

    def receive(self, rank: int, action: Action, clock: float, transfer: Span) -> float:
        """A receive at ``clock`` whose ``transfer`` was posted; the clock after it."""
        return clock

    def hold(self, rank: int, clock: float) -> bool:
        """Whether ``rank`` stops before posting a send at ``clock`` (to be advanced
        again later); never, by default."""
        return False

    def wake(self, ranks: Iterable[int], ready: list[int]) -> None:
        """Ranks that were parked can move again; by default they join ``ready``."""
        ready.extend(ranks)

    def allreduce(self, stage: int, members: Sequence[int]) -> Span:
        """Once per round, when the last replica joins: the all-reduce's span.
        ``self.clock[m]`` is each member's arrival."""
        return _NOTHING

    def gather(self, stage: int, members: Sequence[int]) -> Span:
        """Once per ``UNSHARD`` round, when the last replica joins: the all-gather's span."""
        return _NOTHING

    def agree(self, members: Sequence[int]) -> Span:
        """Once per update, when the last rank reaches its first ``STEP`` of it (with
        ``agree_steps``): the agreement's span."""
        return _NOTHING

    def release(self, rank: int, action: Action, clock: float) -> float:
        """A ``RESHARD`` at ``clock`` (the full weights freed); the clock after it."""
        return clock

    def launch(self, rank: int, action: Action, clock: float) -> None:
        """``rank`` joins the all-reduce ``action`` at ``clock`` and goes on (its ``STEP``
        waits for it), before :meth:`allreduce` may read its arrival."""

    def joined(self, rank: int, action: Action, span: Span) -> float:
        """A member leaves the all-reduce (or all-gather) ``span``; its clock after it."""
        return span[1]

    # ---- the loop --------------------------------------------------------------
    def _advance(self, rank: int, ready: list[int]) -> None:
        acts = self.schedule.actions[rank]
        i, clock = self.position[rank], self.clock[rank]
        posted, parked = self._posted, self._parked
        compute, send, receive = self.compute, self.send, self.receive
        while i < len(acts):
            a = acts[i]
            k = a.kind
            if k is _STEP and self.agree_steps and self._agreed_on[rank] != a.microbatch:
                self.clock[rank] = clock
                span = self._agree(rank, ready)
                if span is None:
                    break
                clock = max(clock, span[1])
                self._agreements[rank] += 1
                self._agreed_on[rank] = a.microbatch
            if k is _STEP and (a.stage, a.microbatch) in self._launched[rank]:
                span = self._rounds.get((a.stage, a.microbatch))
                if span is None:  # parked until the last replica launches it
                    self.clock[rank] = clock
                    self._parked.setdefault((a.stage, a.microbatch), []).append(rank)
                    break
                clock = max(clock, self.joined(rank, Action(_ALLREDUCE, a.stage, a.microbatch),
                                               span))
            if k is _F or k is _B or k is _W or k is _STEP or k is _OVERLAP:
                clock = compute(rank, a, clock)
            elif k is _SEND_F or k is _SEND_B:
                if self.hold(rank, clock):
                    break
                key = a.transfer_key
                assert key is not None
                clock, posted[key] = send(rank, a, clock)
                woken = parked.pop(key, None)
                if woken:
                    self.wake(woken, ready)
            elif k is _RECV_F or k is _RECV_B:
                key = a.transfer_key
                assert key is not None
                got = posted.get(key)
                if got is None:
                    parked.setdefault(key, []).append(rank)
                    break
                clock = receive(rank, a, clock, got)
            elif k is _RESHARD:
                clock = self.release(rank, a, clock)
            elif k is _ALLREDUCE and (a.stage, a.microbatch) in self._launched[rank]:
                self.clock[rank] = clock
                self.launch(rank, a, clock)
                self._launch(rank, a, ready)
            else:
                self.clock[rank] = clock
                span = self._join(rank, a, ready)
                if span is None:
                    break
                clock = self.joined(rank, a, span)
            i += 1
        self.position[rank], self.clock[rank] = i, clock

    def _launch(self, rank: int, action: Action, ready: list[int]) -> None:
        """``rank`` joins the round of ``action`` without waiting; the last to join sets
        its span and wakes the replicas whose ``STEP`` waits for it."""
        self._round((action.stage, action.allreduce_round), rank,
                    self.schedule.replicas[action.stage], ready,
                    lambda members: self.allreduce(action.stage, members), wait=False)

    def _agree(self, rank: int, ready: list[int]) -> Span | None:
        """The span of the rank's next agreement once every rank joined it, else None
        (parked); its rounds are keyed ``(-1, n)``, apart from the stages'."""
        return self._round((-1, self._agreements[rank]), rank, self.schedule.num_ranks,
                           ready, self.agree)

    def _join(self, rank: int, action: Action, ready: list[int]) -> Span | None:
        """The round's span once every replica of the stage joined, else None (parked).
        ``UNSHARD<k>``'s round is keyed ``-1 - k``, apart from the all-reduces'."""
        gathers = action.kind is _UNSHARD
        group = (action.stage, -1 - action.microbatch if gathers else action.allreduce_round)
        hook = self.gather if gathers else self.allreduce
        return self._round(group, rank, self.schedule.replicas[action.stage], ready,
                           lambda members: hook(action.stage, members))

    def _round(self, group: tuple[int, int], rank: int, size: int, ready: list[int],
               span_of: Callable[[Sequence[int]], Span], wait: bool = True) -> Span | None:
        """``rank`` joins the collective ``group`` of ``size`` members: its span once the
        last joined (``span_of`` the members, then the parked ones woken), else None, the
        rank parked unless it goes on without waiting (``wait`` False)."""
        span = self._rounds.get(group)
        if span is not None:
            return span
        members = self._joined.setdefault(group, [])
        members.append(rank)
        if len(members) < size:
            if wait:
                self._parked.setdefault(group, []).append(rank)
            return None
        self.wake(self._parked.pop(group, ()), ready)
        span = self._rounds[group] = span_of(members)
        del self._joined[group]
        return span

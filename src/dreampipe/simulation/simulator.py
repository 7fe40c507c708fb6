"""Discrete-event simulation of a schedule: when each action runs, and what it holds.

Each rank runs its action list in order, exactly as the runtime does, on the
one stepping core the validator dry-runs
(:class:`dreampipe.scheduling.stepping.Stepper`); this module only puts times
on its steps. Compute occupies the rank for the stage's cost per microbatch; a
``SEND`` holds its links for ``bytes / bandwidth`` while the sender computes on
(its directed link inside a server; across servers, its server's link out and
the receiver's server's link in, which the servers' other transfers share); a
``RECV`` waits for the transfer's end; an ``ALLREDUCE`` starts
``allreduce_delay_s`` into the replicas' latest backward and ends
``allreduce_s`` later (a deferred step's waits at its ``STEP``); a ZeRO-3 ``UNSHARD``
starts when the last replica joins and takes ``gather_s``; with ``steps_agree`` a rank's
first ``STEP`` of an update waits for the last rank's. Each rank's peak memory is
:mod:`.rank_memory`'s. Costs come from :mod:`dreampipe.simulation.action_costs`; each
action's cost and what a rank holds: docs/design.md §9. An ``OVERLAP_F_B`` costs its
forward and its backward, one after the other; a hand-off between two stages of one
rank costs nothing.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dreampipe.errors import ScheduleError
from dreampipe.planning.config_string import config_string
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.events import Event
from dreampipe.scheduling.stepping import Span, Stepper
from dreampipe.scheduling.weight_versions import runs_on
from dreampipe.simulation.action_costs import SimCosts, costs_from_plan, costs_from_profile
from dreampipe.simulation.link_calendar import LinkCalendar
from dreampipe.simulation.rank_memory import RankMemory, stash_shares

__all__ = ["SimCosts", "SimResult", "costs_from_plan", "costs_from_profile", "simulate_schedule"]

_F, _B, _W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
_SEND_F, _UNSHARD, _OVERLAP = ActionKind.SEND_F, ActionKind.UNSHARD, ActionKind.OVERLAP


@dataclass(frozen=True)
class SimResult:
    """What a simulated run did; per-rank tuples are indexed by rank.

    ``throughput_minibatches_per_s`` counts profiled minibatches over the whole
    run, start-up and drain included: ``num_microbatches x microbatch_fraction /
    makespan`` (a PipeDream microbatch is one minibatch; with microbatches of
    ``1/M`` of one, ``M`` microbatches make a minibatch). ``bubble_fraction`` is
    the rank time not spent on F/B/STEP over ``ranks x makespan``.

    ``steady_throughput_minibatches_per_s`` leaves start-up and drain out, to
    compare with the planner's steady-state figure: a microbatch is finished when
    its backward at the input stage ends; with ``w`` microbatches in flight there at
    most (the sum of ``peak_in_flight`` over its replicas), the rate between
    the ``w``-th finish and the ``w``-th from the last. ``steady_microbatches`` is the
    number of microbatches finished in that window (after its start, up to its end);
    0 when the run is too short to have one (fewer than ``2w + 2`` microbatches, or
    all of the window's finishing at once), and the steady figure is then the
    whole run's; :meth:`summary` writes it as ``null`` then, so that JSON never
    passes a whole run's rate off as a steady one.
    """

    kind: ScheduleKind
    config: str
    num_microbatches: int
    makespan_s: float
    throughput_minibatches_per_s: float
    steady_throughput_minibatches_per_s: float
    steady_microbatches: int
    busy_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    bubble_fraction: float
    peak_memory_bytes: tuple[int, ...]
    peak_versions: tuple[int, ...]
    peak_in_flight: tuple[int, ...]
    events: tuple[Event, ...] = field(default=(), repr=False)

    def summary(self) -> dict[str, Any]:
        """Everything but the events, as JSON-ready data."""
        return {
            "schedule": self.kind.value,
            "config": self.config,
            "num_microbatches": self.num_microbatches,
            "makespan_s": self.makespan_s,
            "throughput_minibatches_per_s": self.throughput_minibatches_per_s,
            "steady_throughput_minibatches_per_s": (
                self.steady_throughput_minibatches_per_s if self.steady_microbatches else None),
            "steady_microbatches": self.steady_microbatches,
            "bubble_fraction": self.bubble_fraction,
            "busy_s": list(self.busy_s),
            "idle_s": list(self.idle_s),
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "peak_versions": list(self.peak_versions),
            "peak_in_flight": list(self.peak_in_flight),
        }


def simulate_schedule(
    schedule: Schedule, costs: SimCosts, *, record_events: bool = True
) -> SimResult:
    """Time ``schedule`` under ``costs``; ``record_events=False`` skips the event list."""
    if costs.num_stages != schedule.num_stages:
        raise ScheduleError(
            f"costs describe {costs.num_stages} stages but the schedule has "
            f"{schedule.num_stages}; build both from the same plan"
        )
    run = _Run(schedule, costs, record_events)
    stuck = run.run()
    if stuck:
        at = schedule.actions[stuck[0]][run.position[stuck[0]]]
        raise ScheduleError(
            f"simulation stopped with ranks {stuck} blocked (rank {stuck[0]} at "
            f"{at}); run validate() on the schedule"
        )
    return run.result()


class _Run(Stepper):
    """The stepping core with times: compute, links, all-reduces, memory, events."""

    def __init__(self, schedule: Schedule, costs: SimCosts, record: bool) -> None:
        super().__init__(schedule, costs.steps_agree)
        self.c, self.record = costs, record
        ranks = schedule.num_ranks
        self.busy = [0.0] * ranks
        self.last_b_start = [0.0] * ranks
        self.finished: list[float] = []
        self.events: list[Event] = []
        self.calendar = LinkCalendar()
        self._queue: list[tuple[float, int]] = []
        self._held = self._ordered = False
        #: (src, dst): the links a transfer holds and their bandwidth
        self.paths: dict[tuple[int, int], tuple[tuple[tuple[int, int, int], ...], float]] = {}
        self.memory = [RankMemory(schedule.replicas[schedule.stage_of_rank(r)] if any(
            a.kind is _UNSHARD for a in acts) else 1) for r, acts in enumerate(schedule.actions)]
        #: per rank, what a microbatch of each hosted stage holds of its largest stash
        self.shares = [stash_shares(costs.stash_bytes, schedule.stages_of_rank(r))
                       for r in range(ranks)]
        self.draws = random.Random(0)
        #: per rank, its arrival at a launched all-reduce and its backward's start then
        self._launched_at: dict[int, tuple[float, float]] = {}
        self.split = schedule.kind.splits_backward
        self.input_grad_s = tuple(b - w for b, w in zip(costs.backward_s, costs.weight_grad_s,
                                                          strict=True))

    def run(self) -> list[int]:
        """Step the ranks in time order where it matters: a rank posts a send only when
        no rank that can move is earlier, so shared links are booked as time runs. Where
        no link is shared, each rank runs as far as it can, which books the same spans."""
        self._ordered = self.c.shares_links(self.schedule.num_ranks)
        if not self._ordered:
            return super().run()
        self._queue = [(0.0, r) for r in range(self.schedule.num_ranks)]
        while self._queue:
            _, rank = heapq.heappop(self._queue)
            self._held = False
            self._advance(rank, [])
            if self._held:
                heapq.heappush(self._queue, (self.clock[rank], rank))
        return self.blocked()

    def hold(self, rank: int, clock: float) -> bool:
        self._held = bool(self._queue) and self._queue[0][0] < clock
        return self._held

    def wake(self, ranks: Iterable[int], ready: list[int]) -> None:
        """Woken ranks go straight onto the time-ordered queue, at the clock each blocked
        at, so a rank still running holds its next send for them (in depth-first
        stepping, where no link is shared, they join ``ready``)."""
        if not self._ordered:
            ready.extend(ranks)
            return
        for r in ranks:
            heapq.heappush(self._queue, (self.clock[r], r))

    def result(self) -> SimResult:
        s = self.schedule
        makespan = max(self.clock, default=0.0)
        idle = tuple(max(0.0, makespan - b) for b in self.busy)
        total = makespan * s.num_ranks
        hosted = [s.stages_of_rank(r) for r in range(s.num_ranks)]
        cuts = (0.0, *self.c.activation_bytes, 0.0)
        params = [sum(self.c.parameter_bytes[st] for st in h) for h in hosted]
        stash = [max(self.c.stash_bytes[st] for st in h) for h in hosted]
        again = [max(self.c.recompute_bytes[st] for st in h) for h in hosted]
        kept = [max(self.c.held_bytes[st] for st in h) for h in hosted]
        state = [sum(self.c.state_bytes[st] for st in h) for h in hosted]
        sent = [max(max(cuts[st], cuts[st + 1]) for st in h) for h in hosted]
        fraction = self.c.microbatch_fraction
        throughput = s.num_microbatches * fraction / makespan if makespan > 0 else math.inf
        warm = sum(m.peak_in_flight for m in self.memory[: s.replicas[0]])
        steady, window = _steady_rate(sorted(self.finished), warm, fraction)
        return SimResult(
            kind=s.kind,
            config=config_string(s.replicas),
            num_microbatches=s.num_microbatches,
            makespan_s=makespan,
            throughput_minibatches_per_s=throughput,
            steady_throughput_minibatches_per_s=throughput if steady is None else steady,
            steady_microbatches=window,
            busy_s=tuple(self.busy),
            idle_s=idle,
            bubble_fraction=sum(idle) / total if total > 0 else 0.0,
            peak_memory_bytes=tuple(
                int(m.peak_memory(params[r], stash[r], sent[r], kept[r]) + again[r] + state[r])
                for r, m in enumerate(self.memory)),
            peak_versions=tuple(m.peak_versions for m in self.memory),
            peak_in_flight=tuple(m.peak_in_flight for m in self.memory),
            events=tuple(sorted(self.events, key=lambda e: (e.start_s, e.rank))),
        )

    def compute(self, rank: int, action: Action, clock: float) -> float:
        k, st, c = action.kind, action.stage, self.c
        if k is _OVERLAP:  # one after the other: the overlap hides communication, not compute
            forward, backward = action.parts
            end = self.compute(rank, backward, self.compute(rank, forward, clock))
            if self.record:  # the pair, around its two parts' events
                self.events.append(Event(rank, st, k, action.microbatch, clock, end))
            return end
        mem = self.memory[rank]
        # one key per (microbatch, stage) on the rank
        held = action.microbatch * len(c.forward_s) + st
        if k is _F:
            dur = self._jittered(c.forward_s[st])
            mem.forward(held, runs_on(self.schedule.kind, action.microbatch,
                                      self.schedule.microbatches_per_update, mem.version),
                        self.shares[rank].get(st, 1.0))
        elif k is _B:
            dur = self._jittered(self.input_grad_s[st] if self.split else c.backward_s[st])
            self.last_b_start[rank] = clock
            if st == 0:
                self.finished.append(clock + dur)
            if not self.split:
                mem.backward(held)
        elif k is _W:
            dur = self._jittered(c.weight_grad_s[st])
            mem.backward(held)
        else:
            dur = c.step_s[st]
            if mem.pins_live():  # the live weights move to a copy (copy-on-write)
                dur += c.parameter_bytes[st] / c.stash_copy_bandwidth
            mem.step()
        self.busy[rank] += dur
        if self.record:
            self.events.append(Event(rank, st, k, action.microbatch, clock, clock + dur))
        return clock + dur

    def send(self, rank: int, action: Action, clock: float) -> tuple[float, Span]:
        c, st = self.c, action.stage
        dst = self.schedule.peer(rank, action)
        assert dst is not None
        if dst == rank:  # a hand-off between two stages of the rank: no message
            return clock, (clock, clock)
        size = c.activation_bytes[st] if action.kind is _SEND_F else c.gradient_bytes[st - 1]
        clock += c.send_overhead_s + size / c.send_copy_bandwidth
        path = self.paths.get((rank, dst))
        if path is None:
            path = self.paths[(rank, dst)] = (self.c.links_between(rank, dst),
                                              self.c.bandwidth_between(rank, dst))
        links, bandwidth = path
        start, end = self.calendar.transfer(links, clock, size / bandwidth if size > 0 else 0.0)
        if self.record:
            self.events.append(Event(rank, st, action.kind, action.microbatch, start, end))
        return clock, (start, end)

    def receive(self, rank: int, action: Action, clock: float, transfer: Span) -> float:
        start, end = transfer
        if self.record:
            self.events.append(Event(rank, action.stage, action.kind, action.microbatch, start,
                                     end))
        return max(clock, end)

    def launch(self, rank: int, action: Action, clock: float) -> None:
        """A deferred step's all-reduce: the rank's arrival and its backward then, for
        :meth:`allreduce`; the next update's gradients are made beside this one's."""
        self._launched_at[rank] = (clock, self.last_b_start[rank])
        self.memory[rank].launch()

    def allreduce(self, stage: int, members: Sequence[int]) -> Span:
        """Starts ``allreduce_delay_s`` into the latest of the members' preceding
        backwards (gradients go out as they are produced); ends ``allreduce_s``
        later or when the last member arrives (launched, :meth:`launch`)."""
        at = [self._launched_at.pop(m, (self.clock[m], self.last_b_start[m])) for m in members]
        arrived = max(c for c, _ in at)
        cost = self.c.allreduce_s[stage]
        delay = self.c.allreduce_delay_s[stage]
        start = max(b for _, b in at) + delay if cost > 0 else arrived
        return start, max(arrived, start + cost)

    def agree(self, members: Sequence[int]) -> Span:
        """Ends when the last rank arrives."""
        arrived = max(self.clock[m] for m in members)
        return arrived, arrived

    def gather(self, stage: int, members: Sequence[int]) -> Span:
        """Starts when the last member arrives; takes ``gather_s``."""
        arrived = max(self.clock[m] for m in members)
        return arrived, arrived + self.c.gather_s[stage]

    def release(self, rank: int, action: Action, clock: float) -> float:
        self.memory[rank].shard(True)
        return clock

    def joined(self, rank: int, action: Action, span: Span) -> float:
        if action.kind is _UNSHARD:
            self.memory[rank].shard(False)
        if self.record:
            self.events.append(Event(rank, action.stage, action.kind, action.microbatch, *span))
        return span[1]

    def _jittered(self, cost: float) -> float:
        jitter = self.c.jitter
        return cost * jitter[self.draws.randrange(len(jitter))] if jitter else cost



def _steady_rate(finished: list[float], warm: int, fraction: float) -> tuple[float | None, int]:
    """Minibatches per second from the ``warm``-th finish time ``t0`` to the ``warm``-th
    from the last ``t1`` (start-up and drain left out), and the microbatches finished
    in ``(t0, t1]``; ``(None, 0)`` when there is no such window. Counting by
    time, not by index, keeps replicas that finish together (a round of data
    parallelism) from being counted at one end of the window and not the other.
    """
    lo, hi = warm, len(finished) - 1 - warm
    if hi <= lo or finished[hi] <= finished[lo]:
        return None, 0
    t0, t1 = finished[lo], finished[hi]
    microbatches = bisect.bisect_right(finished, t1) - bisect.bisect_right(finished, t0)
    return microbatches * fraction / (t1 - t0), microbatches

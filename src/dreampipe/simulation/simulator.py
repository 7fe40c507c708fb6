"""Discrete-event simulation of a schedule: when each action runs, and what it holds.

Each rank runs its action list in order, exactly as the runtime does:

- ``F``/``B``/``STEP`` occupy the rank for the stage's cost per unit;
- ``SEND`` is non-blocking: the transfer starts when the directed link
  (sender rank -> receiver rank) is free, lasts ``bytes / bandwidth`` and
  holds the link until it ends (one transfer at a time per link), while the
  sender computes on (communication overlaps compute). Posting it occupies
  the sender for ``send_overhead_s + bytes / send_copy_bandwidth`` (zero by
  default; on CPU backends such as gloo the host copies the message on the
  cores that compute);
- ``RECV`` waits until the data has arrived;
- ``ALLREDUCE`` joins the stage's replicas for the same round. Gradients go
  out while the backward produces them (bucketed, as in PyTorch DDP), so it
  starts with the latest of the replicas' preceding backwards and ends
  ``allreduce_s`` later, or when the last of those backwards ends. The rank
  continues (to ``STEP``) only then.

Memory per rank is ``parameter_bytes x (weight versions held + 1) +
stash_bytes x units in flight``, the planner's model (:mod:`dreampipe.planning.costs`;
the extra weights are the gradient buffer); a unit is in flight from its
forward's start to its backward's end. A unit holds the weight version (optimizer steps taken) its
forward ran with; the versions held are those of the units in flight plus
the live one: 1 for the synchronous schedules, ``n-s`` at stage s of a
straight n-stage PipeDream pipeline (weight stashing).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dreampipe.errors import ScheduleError
from dreampipe.planning.plan import Plan, config_string
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.scheduling.actions import ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.events import Event

__all__ = ["SimCosts", "SimResult", "costs_from_plan", "costs_from_profile", "simulate_schedule"]

_K = ActionKind
Bandwidth = Topology | tuple[tuple[float, ...], ...] | float


@dataclass(frozen=True)
class SimCosts:
    """Costs per stage and per unit (one minibatch or microbatch), in s and bytes.

    ``activation_bytes[s]``/``gradient_bytes[s]`` cross the cut between stage
    s and s+1 (forward and backward; gradients default to the activations).
    ``bandwidth`` (bytes/s) between two ranks is a :class:`Topology` (rank i
    is worker i), a rank-by-rank table, or one figure for every link
    (``math.inf``: free communication). Empty per-stage tuples mean zeros.
    ``unit_fraction`` is the unit's share of a profiled minibatch; throughput
    is reported in profiled minibatches. ``send_overhead_s`` and
    ``send_copy_bandwidth`` give the sender's own time to post one message.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    activation_bytes: tuple[float, ...] = ()
    gradient_bytes: tuple[float, ...] = ()
    bandwidth: Bandwidth = math.inf
    allreduce_s: tuple[float, ...] = ()
    parameter_bytes: tuple[float, ...] = ()
    stash_bytes: tuple[float, ...] = ()
    step_s: tuple[float, ...] = ()
    unit_fraction: float = 1.0
    send_overhead_s: float = 0.0
    send_copy_bandwidth: float = math.inf

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        if n == 0 or len(self.backward_s) != n:
            raise ScheduleError(
                f"costs need forward_s and backward_s for every stage, got {len(self.forward_s)} "
                f"and {len(self.backward_s)} entries"
            )
        defaults = {"activation_bytes": n - 1, "allreduce_s": n, "parameter_bytes": n,
                    "stash_bytes": n, "step_s": n}
        for name, size in defaults.items():
            value = tuple(getattr(self, name)) or (0.0,) * size
            if len(value) != size:
                raise ScheduleError(f"costs.{name} has {len(value)} entries; give {size}")
            object.__setattr__(self, name, value)
        grads = tuple(self.gradient_bytes) or self.activation_bytes
        if len(grads) != n - 1:
            raise ScheduleError(f"costs.gradient_bytes has {len(grads)} entries; give {n - 1}")
        object.__setattr__(self, "gradient_bytes", grads)
        if not self.unit_fraction > 0:
            raise ScheduleError(f"unit_fraction={self.unit_fraction}; it must be positive")
        if self.send_overhead_s < 0 or not self.send_copy_bandwidth > 0:
            raise ScheduleError(
                f"send_overhead_s={self.send_overhead_s}, send_copy_bandwidth="
                f"{self.send_copy_bandwidth}: give an overhead >= 0 and a bandwidth > 0"
            )

    @property
    def num_stages(self) -> int:
        return len(self.forward_s)

    def bandwidth_between(self, a: int, b: int) -> float:
        if isinstance(self.bandwidth, Topology):
            return self.bandwidth.bandwidth_between(a, b)
        if isinstance(self.bandwidth, tuple):
            return self.bandwidth[a][b]
        return float(self.bandwidth)


@dataclass(frozen=True)
class SimResult:
    """What a simulated run did; per-rank tuples are indexed by rank.

    ``throughput_minibatches_per_s`` counts profiled minibatches over the whole
    run, start-up and drain included: ``num_units x unit_fraction /
    makespan`` (a PipeDream unit is one minibatch; with microbatches of
    ``1/M`` of one, ``M`` units make a minibatch). ``bubble_fraction`` is
    the rank time not spent on F/B/STEP over ``ranks x makespan``.
    """

    kind: ScheduleKind
    config: str
    num_units: int
    makespan_s: float
    throughput_minibatches_per_s: float
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
            "num_units": self.num_units,
            "makespan_s": self.makespan_s,
            "throughput_minibatches_per_s": self.throughput_minibatches_per_s,
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
    return _Run(schedule, costs, record_events).result()


class _Run:
    """The event loop: each rank advances until it blocks; sends wake receivers."""

    def __init__(self, schedule: Schedule, costs: SimCosts, record: bool) -> None:
        self.s, self.c, self.record = schedule, costs, record
        ranks = schedule.num_ranks
        self.clock = [0.0] * ranks
        self.busy = [0.0] * ranks
        self.last_b_start = [0.0] * ranks
        self.events: list[Event] = []
        self.arrival: dict[tuple[int, int, int], tuple[float, float]] = {}
        self.link_free: dict[tuple[int, int], float] = {}
        self.bandwidth: dict[tuple[int, int], float] = {}
        self.waiting: dict[Any, list[int]] = {}
        self.groups: dict[tuple[int, int], list[int]] = {}
        self.done: dict[tuple[int, int], tuple[float, float]] = {}
        self.memory = [_Memory() for _ in range(ranks)]

    def result(self) -> SimResult:
        s = self.s
        pc = [0] * s.num_ranks
        ready = list(range(s.num_ranks))
        while ready:
            rank = ready.pop()
            pc[rank] = self._advance(rank, pc[rank], ready)
        stuck = [r for r in range(s.num_ranks) if pc[r] < len(s.actions[r])]
        if stuck:
            raise ScheduleError(
                f"simulation stopped with ranks {stuck} blocked (rank {stuck[0]} at "
                f"{s.actions[stuck[0]][pc[stuck[0]]]}); run validate() on the schedule"
            )
        makespan = max(self.clock, default=0.0)
        idle = tuple(max(0.0, makespan - b) for b in self.busy)
        total = makespan * s.num_ranks
        stages = [s.stage_of_rank(r) for r in range(s.num_ranks)]
        params, stash = self.c.parameter_bytes, self.c.stash_bytes
        return SimResult(
            kind=s.kind,
            config=config_string(s.replicas),
            num_units=s.num_units,
            makespan_s=makespan,
            throughput_minibatches_per_s=(
                s.num_units * self.c.unit_fraction / makespan if makespan > 0 else math.inf),
            busy_s=tuple(self.busy),
            idle_s=idle,
            bubble_fraction=sum(idle) / total if total > 0 else 0.0,
            peak_memory_bytes=tuple(
                int(m.peak_memory(params[st], stash[st])) for m, st in zip(
                    self.memory, stages, strict=True)),
            peak_versions=tuple(m.peak_versions for m in self.memory),
            peak_in_flight=tuple(m.peak_in_flight for m in self.memory),
            events=tuple(sorted(self.events, key=lambda e: (e.start_s, e.rank))),
        )

    def _advance(self, rank: int, i: int, ready: list[int]) -> int:
        acts, c, clock = self.s.actions[rank], self.c, self.clock[rank]
        mem, record, events = self.memory[rank], self.record, self.events
        while i < len(acts):
            a = acts[i]
            k, st = a.kind, a.stage
            if k is _K.FORWARD or k is _K.BACKWARD or k is _K.STEP:
                dur = c.forward_s[st] if k is _K.FORWARD else (
                    c.backward_s[st] if k is _K.BACKWARD else c.step_s[st])
                start, clock = clock, clock + dur
                self.busy[rank] += dur
                if k is _K.FORWARD:
                    mem.forward(a.unit)
                elif k is _K.BACKWARD:
                    self.last_b_start[rank] = start
                    mem.backward(a.unit)
                else:
                    mem.step()
            elif k is _K.SEND_F or k is _K.SEND_B:
                fwd = k is _K.SEND_F
                dst = self.s.rank_of(st + 1 if fwd else st - 1, a.unit)
                size = c.activation_bytes[st] if fwd else c.gradient_bytes[st - 1]
                clock += c.send_overhead_s + size / c.send_copy_bandwidth
                start = max(clock, self.link_free.get((rank, dst), 0.0))
                end = start + self._transfer_s(rank, dst, size)
                self.link_free[(rank, dst)] = end
                key = (0 if fwd else 1, st, a.unit)
                self.arrival[key] = (start, end)
                ready.extend(self.waiting.pop(key, ()))
                if record:
                    events.append(Event(rank, st, k, a.unit, start, end))
                i += 1
                continue
            elif k is _K.RECV_F or k is _K.RECV_B:
                key = (0, st - 1, a.unit) if k is _K.RECV_F else (1, st + 1, a.unit)
                got = self.arrival.get(key)
                if got is None:
                    self.waiting.setdefault(key, []).append(rank)
                    break
                start, end = got
                clock = max(clock, end)
                if record:
                    events.append(Event(rank, st, k, a.unit, start, end))
                i += 1
                continue
            else:
                self.clock[rank] = clock
                done = self._allreduce(rank, st, self.s.allreduce_round(a), ready)
                if done is None:
                    break
                start, clock = done
            if record:
                events.append(Event(rank, st, k, a.unit, start, clock))
            i += 1
        self.clock[rank] = clock
        return i

    def _allreduce(
        self, rank: int, stage: int, rnd: int, ready: list[int]
    ) -> tuple[float, float] | None:
        """(start, end) once every replica of ``stage`` has arrived, else None."""
        group = (stage, rnd)
        done = self.done.get(group)
        if done is not None:
            return done
        members = self.groups.setdefault(group, [])
        members.append(rank)
        if len(members) < self.s.replicas[stage]:
            self.waiting.setdefault(group, []).append(rank)
            return None
        ready.extend(self.waiting.pop(group, ()))
        arrived = max(self.clock[m] for m in members)
        cost = self.c.allreduce_s[stage]
        start = max(self.last_b_start[m] for m in members) if cost > 0 else arrived
        done = self.done[group] = (start, max(arrived, start + cost))
        del self.groups[group]
        return done

    def _transfer_s(self, src: int, dst: int, size: float) -> float:
        if size <= 0:
            return 0.0
        bw = self.bandwidth.get((src, dst))
        if bw is None:
            bw = self.bandwidth[(src, dst)] = self.c.bandwidth_between(src, dst)
        return size / bw


class _Memory:
    """Units in flight on one rank and the weight versions they pin."""

    def __init__(self) -> None:
        self.version = 0
        self.unit_version: dict[int, int] = {}
        self.counts: Counter[int] = Counter()
        self.peak_in_flight = 0
        self.peak_versions = 1
        self.samples: set[tuple[int, int]] = {(1, 0)}

    def forward(self, unit: int) -> None:
        self.unit_version[unit] = self.version
        self.counts[self.version] += 1
        self._sample()

    def backward(self, unit: int) -> None:
        self._sample()
        v = self.unit_version.pop(unit, None)
        if v is not None:
            self.counts[v] -= 1
            if not self.counts[v]:
                del self.counts[v]

    def step(self) -> None:
        self.version += 1
        self._sample()

    def _sample(self) -> None:
        versions = len(self.counts) + (self.version not in self.counts)
        flight = len(self.unit_version)
        self.peak_in_flight = max(self.peak_in_flight, flight)
        self.peak_versions = max(self.peak_versions, versions)
        self.samples.add((versions, flight))

    def peak_memory(self, parameter_bytes: float, stash_bytes: float) -> float:
        return max((v + 1) * parameter_bytes + f * stash_bytes for v, f in self.samples)


def costs_from_profile(
    graph: LayerGraph, plan: Plan, topology: Topology, unit_fraction: float = 1.0
) -> SimCosts:
    """Per-unit costs of ``plan``'s stages from the layer profile.

    Compute, activations and stashed bytes scale linearly with
    ``unit_fraction`` (unit size / profiled minibatch). A replicated stage's
    all-reduce is a ring, ``2(r-1)/r x |w| / B`` over the slowest link
    between its ranks. Stashed bytes per unit are the stage's layer outputs,
    as the planner counts them.
    """
    if plan.num_layers != len(graph):
        raise ScheduleError(
            f"the plan covers {plan.num_layers} layers but the profile has {len(graph)}; "
            "simulate a plan with the profile it was made from"
        )
    if plan.workers_used > topology.num_workers:
        raise ScheduleError(
            f"the plan uses {plan.workers_used} workers but topology {topology.shape} has "
            f"{topology.num_workers}; pick a larger --topology"
        )
    cuts = graph.cut_bytes()
    layers = graph.layers
    fwd, bwd, act, params, stash, allreduce = [], [], [], [], [], []
    for s, st in enumerate(plan.stages):
        span = layers[st.first:st.last + 1]
        fwd.append(sum(x.forward_ms for x in span) / 1e3 * unit_fraction)
        bwd.append(sum(x.backward_ms for x in span) / 1e3 * unit_fraction)
        w = float(sum(x.parameter_bytes for x in span))
        params.append(w)
        stash.append(sum(x.activation_bytes for x in span) * unit_fraction)
        if s + 1 < plan.num_stages:
            act.append(cuts[st.last + 1] * unit_fraction)
        allreduce.append(_ring_allreduce_s(w, st.ranks, topology))
    return SimCosts(
        tuple(fwd), tuple(bwd), tuple(act), (), topology, tuple(allreduce), tuple(params),
        tuple(stash), (), unit_fraction,
    )


def costs_from_plan(plan: Plan, topology: Topology, unit_fraction: float = 1.0) -> SimCosts:
    """Approximate costs from a plan's own predictions, when no profile is at hand.

    Forward takes a third of ``compute_s`` and backward two thirds (the usual
    ratio); each direction of the cut moves ``comm_s / 2`` worth of bytes at
    the slowest link across it; memory is unknown (zero).
    """
    fwd = tuple(st.compute_s / 3 * unit_fraction for st in plan.stages)
    bwd = tuple(2 * st.compute_s / 3 * unit_fraction for st in plan.stages)
    act = []
    for a, b in zip(plan.stages, plan.stages[1:], strict=False):
        bw = min(topology.bandwidth_between(x, y) for x in a.ranks for y in b.ranks)
        act.append(a.comm_s / 2 * bw * unit_fraction if math.isfinite(bw) else 0.0)
    return SimCosts(
        fwd, bwd, tuple(act), (), topology, tuple(st.allreduce_s for st in plan.stages),
        unit_fraction=unit_fraction,
    )


def _ring_allreduce_s(parameter_bytes: float, ranks: Sequence[int], topology: Topology) -> float:
    r = len(ranks)
    if r < 2 or parameter_bytes <= 0:
        return 0.0
    bw = min(topology.bandwidth_between(a, b) for a in ranks for b in ranks if a != b)
    return 2 * (r - 1) / r * parameter_bytes / bw

"""The cost of a laid-out pipeline: the default model's terms for stages on given workers.

One function prices every plan the planner reports, so the DP's optimum,
:func:`~dreampipe.planning.planner.evaluate_plan` of a partition chosen by
hand, the baselines and the simulator's all-reduce all read the same terms
(:mod:`dreampipe.planning.costs`, :mod:`dreampipe.planning.sync`):

- a stage on workers ``W`` all-reduces over ``replica_groups(W)``, once per
  round, hidden behind its backward only, from the moment its last weighted
  layer's gradient is final: ``max(C, F + delay + allreduce) / r``
  (:func:`~dreampipe.planning.costs.allreduce_end`);
- the cut after it crosses the innermost level at which it meets the next
  stage's workers, and is shared by the copies of the pipeline at that
  level (one per unit of that level holding the stage)::

      4x4, stage A on workers {0, 1, 4, 5}, stage B on {2, 3, 6, 7}:
      A and B meet inside servers 0 and 1 (level 0, 2 copies):
      cut = 2 (alpha_0 + a / B_0) / 2

  and at least the busiest server link it shares (:mod:`~dreampipe.planning.shared_links`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from dreampipe.planning.costs import FloatArray, RangeCosts, allreduce_end, cut_time
from dreampipe.planning.in_flight import (
    IN_FLIGHT_CHOICES,
    in_flight_counts,
    loop_counts,
    loop_seconds,
)
from dreampipe.planning.plan import Stage
from dreampipe.planning.shared_links import shared_link_seconds
from dreampipe.planning.split_ranges import StageSplit
from dreampipe.planning.sync import Sync, allreduce_terms, replica_groups
from dreampipe.planning.topology import Topology

__all__ = [
    "contiguous_cut_shares", "cut_seconds", "price_stages", "slowest", "stage_allreduce",
]


def stage_allreduce(
    backward_s: FloatArray | Sequence[float], weight_bytes: FloatArray | Sequence[float],
    workers: Sequence[int],
    topology: Topology, sync: Sync,
) -> tuple[float, float]:
    """``(all-reduce s, delay s)`` of a stage whose layers have these backwards and weights.

    The all-reduce is one of the stage's weights among its replicas on
    ``workers``; the delay is how long into the backward it ends later than
    if it had started with the backward (``allreduce_end - allreduce``).
    """
    total = float(sum(weight_bytes))
    if len(workers) < 2 or total <= 0:
        return 0.0, 0.0
    groups = replica_groups(workers, topology)
    lat, per = allreduce_terms(groups, topology.levels, sync, len(workers))
    ar = lat + per * total
    end = float(allreduce_end(backward_s, weight_bytes, lat, per, overlap=topology.overlap)[0, -1])
    return ar, max(0.0, end - ar)


def cut_seconds(
    activation_bytes: float, senders: Sequence[int], receivers: Sequence[int], topology: Topology
) -> float:
    """Per minibatch, the cut between stages on ``senders`` and ``receivers`` (module doc).

    When the two stages hold the same units at the innermost level where
    they meet, the pipeline runs as one copy per unit and the copies share
    the cut. Otherwise each (sender, receiver) pair carries an equal share,
    and each level's links carry the pairs that first meet at that level:
    ``max over levels k of 2 (alpha_k + share_k a / B_k)``.
    """
    size = 1
    for level in topology.levels:
        size *= level.count
        held = {w // size for w in senders}
        got = {w // size for w in receivers}
        if held == got:
            one = float(cut_time(activation_bytes, level.bandwidth, level.latency))
            return one / len(held)
        if held & got:
            break
    return _spread_cut(activation_bytes, senders, receivers, topology)


def _spread_cut(
    activation_bytes: float, senders: Sequence[int], receivers: Sequence[int], topology: Topology
) -> float:
    """The cut when every (sender, receiver) pair carries an equal share (:func:`cut_seconds`)."""
    pairs, size, met, worst = len(senders) * len(receivers), 1, 0, 0.0
    for level in topology.levels:
        size *= level.count
        count: dict[int, list[int]] = {}
        for w in senders:
            count.setdefault(w // size, [0, 0])[0] += 1
        for w in receivers:
            count.setdefault(w // size, [0, 0])[1] += 1
        within = sum(a * b for a, b in count.values())
        if within > met:
            share = (within - met) / pairs
            worst = max(worst, float(cut_time(share * activation_bytes, level.bandwidth,
                                              level.latency)))
        met = within
    return worst


def contiguous_cut_shares(topology: Topology, points: Sequence[int] | None = None) -> FloatArray:
    """``[s, e, f, k]``: the share of the pairs of workers ``P[s]..P[e]-1`` and
    ``P[e]..P[f]-1`` that first meet at level ``k``, as :func:`cut_seconds` counts them
    (0 where not ``s < e < f``); ``P`` is ``points`` (default: every worker boundary
    ``0..W``).

    With contiguous ranges only the level-``k`` unit holding both ``P[e] - 1``
    and ``P[e]`` holds pairs, ``(its senders) x (its receivers)`` of them.
    """
    idx = np.arange(topology.num_workers + 1) if points is None else np.asarray(points)
    size_k = len(idx)
    s, e, f = idx[:, None, None], idx[None, :, None], idx[None, None, :]
    valid = (s < e) & (e < f)
    pairs = np.where(valid, (e - s) * (f - e), 1)
    out = np.zeros((size_k, size_k, size_k, len(topology.levels)))
    met = np.zeros((size_k, size_k, size_k))
    size = 1
    for k, level in enumerate(topology.levels):
        size *= level.count
        start = (e - 1) // size * size  # the unit of worker e - 1
        shared = (e < start + size) & valid
        within = np.where(shared, (e - np.maximum(s, start)) * (np.minimum(f, start + size) - e),
                          0)
        out[..., k] = (within - met) / pairs
        met = within.astype(np.float64)
    return out


def price_stages(
    prof: RangeCosts,
    topology: Topology,
    spans: Sequence[tuple[int, int]],
    placements: Sequence[Sequence[int]],
    sync: Sync,
    memory_bytes: int | None = None,
    recompute: Sequence[bool] = (),
    splits: Sequence[StageSplit | None] = (),
    shared_links: bool = True,
) -> tuple[Stage, ...]:
    """Stages ``first..last`` on the given workers, ranks numbered stage by stage, priced.

    Each stage holds the minibatches in flight of the first of
    :data:`~dreampipe.planning.in_flight.IN_FLIGHT_CHOICES` whose stages all fit in
    ``memory_bytes`` (PipeDream's count when no other does; None: no limit).
    A stage marked in ``recompute`` (empty: none) runs its forward once more in the
    backward, before the gradients its all-reduce sends (``compute_s`` and the
    all-reduce's delay grow by ``F``), and keeps only its inputs per minibatch.
    A stage given a split in ``splits`` (empty: none) runs each replica on ``t``
    consecutive workers of its placement, priced by the split's own table
    (:mod:`dreampipe.planning.split_ranges`): its replicas all-reduce among their
    first workers (``Stage.workers``), and its cuts are priced over all its workers,
    which all hold its replicated input and output. A cut is priced no faster than the
    busiest server link it shares with other cuts (:mod:`~dreampipe.planning.shared_links`)
    unless ``shared_links`` is off (the range program's own price of the plan).
    With them, unreplicated neighbours also hold the minibatches in flight their 1F1B
    loops need for the stages' own period, or the least period the memory allows, and a
    stage takes at least its slowest loop (:func:`~dreampipe.planning.in_flight.
    loop_seconds`).
    """
    how = tuple(splits) or (None,) * len(spans)
    widths = [1 if x is None else x.t for x in how]
    tables = [prof if x is None else x.costs for x in how]
    replicas = [len(p) // t for p, t in zip(placements, widths, strict=True)]
    flags = tuple(recompute) or (False,) * len(spans)
    for join, aligned in IN_FLIGHT_CHOICES:
        counts = in_flight_counts(replicas, join, widths, aligned)
        memories = [c.memory(first, last, v, recompute=rc)
                    for c, (first, last), v, rc in zip(tables, spans, counts, flags, strict=True)]
        if memory_bytes is None or max(memories) <= memory_bytes:
            break
    stages, rank = [], 0
    for s, ((first, last), workers) in enumerate(zip(spans, placements, strict=True)):
        comm = 0.0
        if s + 1 < len(spans):
            comm = cut_seconds(float(prof.cut_bytes[last + 1]), workers, placements[s + 1],
                               topology)
        r, t, costs, split = replicas[s], widths[s], tables[s], how[s]
        firsts = _dealt(sorted(workers), t, topology.levels[0].count)
        assert costs.layer_backward_s is not None and costs.layer_weights is not None
        ar, delay = stage_allreduce(costs.layer_backward_s[first:last + 1],
                                    costs.layer_weights[first:last + 1], firsts, topology, sync)
        compute = float(costs.compute_s[first, last])
        forward = min(float(costs.forward[first, last]), compute)
        again = forward if flags[s] else 0.0
        stages.append(Stage(
            first=first, last=last, replicas=r, ranks=tuple(range(rank, rank + r)),
            compute_s=compute + again, forward_s=forward, comm_s=comm,
            allreduce_s=ar, allreduce_delay_s=delay + again if ar > 0 else delay,
            memory_bytes=memories[s], workers=tuple(firsts), in_flight=counts[s],
            recompute=flags[s], tensor_parallel=t,
            splits=() if split is None else split.layers(first, last),
        ))
        rank += r
    if not shared_links:
        return tuple(stages)
    shared = shared_link_seconds([float(prof.cut_bytes[last + 1]) for _, last in spans[:-1]],
                                 [st.workers for st in stages], topology)
    stages = [replace(st, shared_link_s=shared[s]) if s < len(shared) else st
              for s, st in enumerate(stages)]
    return _looped(tables, spans, flags, stages, memory_bytes)


def _dealt(workers: Sequence[int], t: int, size: int) -> list[int]:
    """The first workers of a stage's replicas (``t`` workers each) on sorted ``workers``,
    in the order minibatches are dealt to them. A range of workers, as the runtime's ranks
    hold a stage, keeps worker order. Any other layout (copies of one server's stages on
    others, ``size`` workers a server) deals each server's first replica, then each
    server's second, and so on: stages beside each other on the same servers then pass
    every minibatch inside one, as :func:`cut_seconds` prices them, where worker order
    would send most to another server when their counts a server differ (docs/design.md
    §4.6)."""
    firsts = list(workers[::t])
    if not workers or workers[-1] - workers[0] == len(workers) - 1:
        return firsts
    seen: dict[int, int] = {}
    nth = []
    for w in firsts:
        nth.append(seen.get(w // size, 0))
        seen[w // size] = nth[-1] + 1
    return [w for _, w in sorted(zip(nth, firsts, strict=True))]


#: Bisection steps on the period whose loops a memory-bound plan holds (about 0.02% of
#: the loops' excess over the stages' period).
_LOOP_STEPS = 12


def _looped(tables: Sequence[RangeCosts], spans: Sequence[tuple[int, int]],
            flags: Sequence[bool], stages: Sequence[Stage], memory_bytes: int | None
            ) -> tuple[Stage, ...]:
    """``stages`` holding the minibatches in flight their 1F1B loops ask for the stages'
    own period, or, where the memory does not allow it, for the least period it allows
    (a bisection), each stage with its slowest loop's time (:func:`price_stages`)."""
    replicas = [st.replicas for st in stages]
    counts = tuple(st.in_flight for st in stages)
    compute = [st.compute_s for st in stages]
    cuts = [st.comm_s for st in stages]
    period = slowest(stages, loops=False)

    def memories(held: Sequence[int]) -> list[int]:
        return [c.memory(first, last, v, recompute=rc)
                for c, (first, last), v, rc in zip(tables, spans, held, flags, strict=True)]

    def fitted(target: float) -> tuple[int, ...] | None:
        held = loop_counts(counts, replicas, compute, cuts, target)
        fits = memory_bytes is None or held == counts or max(memories(held)) <= memory_bytes
        return held if fits else None

    held = counts
    worst = max(loop_seconds(counts, replicas, compute, cuts), default=0.0)
    if worst > period:
        got = fitted(period)
        if got is None:
            lo, hi = period, worst
            for _ in range(_LOOP_STEPS):
                mid = (lo + hi) / 2
                trial = fitted(mid)
                if trial is None:
                    lo = mid
                else:
                    hi, held = mid, trial
        else:
            held = got
    room = memories(held) if held != counts else [st.memory_bytes for st in stages]
    loops = loop_seconds(held, replicas, compute, cuts)
    return tuple(replace(st, in_flight=held[s], memory_bytes=room[s], loop_s=loops[s])
                 for s, st in enumerate(stages))


def slowest(stages: Sequence[Stage], loops: bool = True) -> float:
    """The pipeline's time per minibatch: its slowest stage or cut; without the stages'
    1F1B loops where not ``loops`` (what the searches price)."""
    if not loops:
        stages = [replace(st, loop_s=0.0) for st in stages]
    return max((st.time_s for st in stages), default=math.inf)

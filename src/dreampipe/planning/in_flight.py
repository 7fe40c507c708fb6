"""How many minibatches each stage of a PipeDream pipeline holds in flight.

A replica of stage ``s`` runs that many forwards before its first backward
(1F1B's warm-up) and stashes that many weight versions, so the count sets
both throughput and memory. PipeDream's rule gives each worker from the stage
to the end one minibatch, shared by the stage's replicas; a join buffer adds
``join`` per replica beyond one of the stages after::

    in_flight(s) = ceil((W_s + join * E_s) / r_s),
    E_s = sum of (r_i - 1) over stages i >= s      (0 for the last stage)

*Aligned*, each stage's minibatches in flight over all its replicas also lead the
next stage's by a whole exchange of their rounds (:func:`round_lead`), so a round of the
next stage's backwards frees whole rounds of this stage's forwards and no replica
waits at its all-reduce for inputs freed a round late. The default is aligned, with
a join buffer of 2; a plan keeps the first of :data:`IN_FLIGHT_CHOICES` that fits its
memory, and the last, PipeDream's own rule, is what the planner's search checks.
Unreplicated neighbours also need leads for their 1F1B loops across slow cuts
(:func:`loop_seconds`, :func:`loop_counts`). Why, and the evidence: docs/design.md
§5.2, §10.3.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from dreampipe.errors import PlanError

__all__ = ["IN_FLIGHT_CHOICES", "in_flight_counts", "loop_counts", "loop_seconds",
           "round_lead", "short_of_rounds", "versions_in_flight"]

#: ``(join, aligned)`` as a plan tries them, best first: the first whose stages all
#: fit in memory is kept. Whole rounds matter more than the join buffer's depth
#: (docs/design.md §5.2), so every aligned choice comes first; PipeDream's own rule,
#: last, is what the planner's search checks, so one always fits.
IN_FLIGHT_CHOICES: tuple[tuple[int, bool], ...] = (
    (2, True), (1, True), (0, True), (2, False), (1, False), (0, False))


def versions_in_flight(workers_to_end: int, replicas: int) -> int:
    """PipeDream's count: ``ceil(F / r)``, ``n - s`` at stage ``s`` of a straight pipeline."""
    return -(-workers_to_end // replicas)


def in_flight_counts(replicas: Sequence[int], join: int = IN_FLIGHT_CHOICES[0][0],
                     widths: Sequence[int] = (), aligned: bool = True) -> tuple[int, ...]:
    """Minibatches per replica of each stage in flight (module doc), ``join`` as given,
    rounded to whole rounds if ``aligned``; ``widths[s]`` the workers of each replica
    of stage ``s`` (empty: 1 each)."""
    if join < 0:
        raise PlanError(f"join={join}; use 0 (PipeDream's rule) or more")
    t = list(widths) or [1] * len(replicas)
    out = []
    for s, r in enumerate(replicas):
        extra = sum(m - 1 for m in replicas[s:]) if s < len(replicas) - 1 else 0
        after = sum(m * w for m, w in zip(replicas[s + 1:], t[s + 1:], strict=True))
        out.append(versions_in_flight(r + after + join * extra, r))
    return _aligned(replicas, out) if aligned else tuple(out)


def round_lead(upstream: int, downstream: int) -> int:
    """How many more minibatches a stage of ``upstream`` replicas holds in flight, over
    all of them, than the next stage of ``downstream`` replicas: one round when they are
    as many, else ``max(lcm, 2 max)`` of the two (docs/design.md §5.2)."""
    if upstream == downstream:
        return upstream
    return max(math.lcm(upstream, downstream), 2 * max(upstream, downstream))


def short_of_rounds(replicas: Sequence[int], widths: Sequence[int],
                    held: Sequence[int]) -> tuple[int, ...]:
    """The stages that hold fewer minibatches in flight (``held``, per replica) than whole
    rounds need without a join buffer: where the planner's steady state does not hold,
    as replicas wait for each other at each all-reduce (docs/design.md §5.2)."""
    need = in_flight_counts(replicas, 0, widths)
    return tuple(s for s, (h, n) in enumerate(zip(held, need, strict=True)) if h < n)


def loop_seconds(counts: Sequence[int], replicas: Sequence[int], compute: Sequence[float],
                 cuts: Sequence[float]) -> tuple[float, ...]:
    """Per stage, its slowest 1F1B loop per minibatch with the unreplicated stages after
    it (0 where it or the next is replicated).

    Under 1F1B a stage's next forward waits for a backward that waits, stage by stage
    down to stage ``u``, for the forwards before it, so unreplicated stages ``s..u``,
    their compute ``C`` and their cuts (``cuts[t]``: both ways) take
    ``sum C + sum cut`` per ``n_s - n_u + 1`` minibatches in flight: PipeDream's leads of
    one hold only where the cuts are short beside the stages (docs/design.md §5.2)."""
    return tuple(max((total / max(1, counts[s] - counts[u] + 1)
                      for u, total in _runs(s, replicas, compute, cuts)), default=0.0)
                 for s in range(len(counts)))


def loop_counts(counts: Sequence[int], replicas: Sequence[int], compute: Sequence[float],
                cuts: Sequence[float], period: float) -> tuple[int, ...]:
    """``counts`` raised, from the last stage up, until every loop of
    :func:`loop_seconds` takes at most ``period``; each stage's total in flight keeps at
    least its lead over the next stage's, in whole minibatches per replica."""
    total = [n * r for n, r in zip(counts, replicas, strict=True)]
    out = list(counts)
    for s in range(len(counts) - 2, -1, -1):
        lead = total[s] - total[s + 1]
        need = -(-(out[s + 1] * replicas[s + 1] + lead) // replicas[s])
        if period > 0:
            for u, run in _runs(s, replicas, compute, cuts):
                need = max(need, out[u] + math.ceil(run / period * (1 - 1e-12)) - 1)
        out[s] = max(out[s], need)
    return tuple(out)


def _runs(s: int, replicas: Sequence[int], compute: Sequence[float], cuts: Sequence[float]
          ) -> Iterator[tuple[int, float]]:
    """Each stage ``u`` after ``s`` while ``s..u`` are unreplicated, with their loop's
    ``sum C + sum cut`` (:func:`loop_seconds`)."""
    total = compute[s]
    for u in range(s + 1, len(replicas)):
        if replicas[u - 1] > 1 or replicas[u] > 1:
            return
        total += compute[u] + cuts[u - 1]
        yield u, total


def _aligned(replicas: Sequence[int], counts: Sequence[int]) -> tuple[int, ...]:
    """``counts`` with each stage's total in flight raised, from the last stage up, to at
    least the next stage's total and its :func:`round_lead`, in whole minibatches per replica."""
    total = [n * r for n, r in zip(counts, replicas, strict=True)]
    for s in range(len(total) - 2, -1, -1):
        need = max(total[s], total[s + 1] + round_lead(replicas[s], replicas[s + 1]))
        total[s] = -(-need // replicas[s]) * replicas[s]
    return tuple(n // r for n, r in zip(total, replicas, strict=True))

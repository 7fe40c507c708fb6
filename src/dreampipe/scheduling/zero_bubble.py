"""Zero Bubble's handcrafted schedules (Qi et al., ICLR 2024) as per-replica orders.

The backward splits into ``B``, the input gradient the stage before waits
for, and ``W``, the weight gradient nobody waits for; putting ``W`` off lets
``B`` run down the pipeline at once, and the ``W`` put off fill the drain's
bubble. Per minibatch a replica of stage ``s`` runs ``w_s`` forwards, then for
each microbatch ``j``::

    B<j>  W<j - d_s>  F<j + w_s>          then the W not yet run

``zb-h1`` holds at most 1F1B's peak of microbatches, ``zb-h2`` about twice
that, its extra forwards filling the warm-up too (:func:`zero_bubble_counts`).
Both flush every minibatch, so their updates are synchronous
(docs/design.md §7.6).
"""

from __future__ import annotations

from collections.abc import Sequence

from dreampipe.scheduling.actions import Action, ActionKind, ScheduleKind

__all__ = ["zero_bubble_counts", "zero_bubble_order"]

_F, _B, _W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


def zero_bubble_counts(
    kind: ScheduleKind, warmup: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(w_s, d_s)`` per stage for ``kind``, from 1F1B's in-flight counts ``warmup``
    (:func:`~dreampipe.planning.in_flight.in_flight_counts` with no join): ``zb-h1``
    takes ``w_s = warmup[s]`` and ``d_s = w_0 - w_s``, ``zb-h2`` takes ``2 warmup[s] - 1``
    and ``2 (w_0 - warmup[s])`` (docs/design.md §7.6)."""
    top = warmup[0]
    if kind is ScheduleKind.ZB_H1:
        return tuple(warmup), tuple(max(0, top - w) for w in warmup)
    assert kind is ScheduleKind.ZB_H2, kind
    return tuple(2 * w - 1 for w in warmup), tuple(max(0, 2 * (top - w)) for w in warmup)


def zero_bubble_order(microbatches: list[int], warmup: int, defer: int, stage: int) -> list[Action]:
    """One replica's minibatch: ``warmup`` forwards, then ``B``, the ``W`` put off by
    ``defer`` microbatches and the next ``F``; the ``W`` left over at the end."""
    w = min(warmup, len(microbatches))
    acts = [Action(_F, stage, u) for u in microbatches[:w]]
    done = 0
    for j, u in enumerate(microbatches):
        acts.append(Action(_B, stage, u))
        if j >= defer:
            acts.append(Action(_W, stage, microbatches[done]))
            done += 1
        if j + w < len(microbatches):
            acts.append(Action(_F, stage, microbatches[j + w]))
    acts += [Action(_W, stage, u) for u in microbatches[done:]]
    return acts

"""Zero Bubble's handcrafted schedules (Qi et al., ICLR 2024) as per-replica orders.

The backward splits into ``B``, the input gradient the stage before waits
for, and ``W``, the weight gradient nobody waits for. Putting ``W`` off lets
``B`` run down the pipeline at once, and the ``W`` put off fill the bubbles
of the drain. Per minibatch of ``m`` microbatches, a replica of stage ``s``
runs ``w_s`` forwards, then for each microbatch ``j``::

    B<j>  W<j - d_s>  F<j + w_s>          then the W not yet run

- ``zb-h1``: ``w_s`` is 1F1B's warm-up plus one (``p - s`` on a straight
  pipeline of ``p`` stages) and ``d_s = w_0 - w_s`` (``s``): a stage holds
  at most ``w_0`` microbatches between their forward and their ``W``, 1F1B's
  peak (stage 0's). With ``F = B = W`` its bubble is ``(p-1)(F+B-W)``, a
  third of 1F1B's ``(p-1)(F+B+W)``.
- ``zb-h2``: ``w_s = 2 w_s' - 1`` with ``w_s'`` as above and ``d_s =
  2(w_0 - w_s')``: up to ``2 w_0 - 1`` microbatches held (about twice 1F1B's
  memory); the extra forwards fill the warm-up's bubble as well, which pays
  when ``B`` takes longer than ``W``.

A microbatch's activations stay until its ``W`` (the weight gradient needs
the stage's inputs and output gradients). Both schedules flush every
minibatch, so their updates are synchronous, as 1f1b-flush's.
"""

from __future__ import annotations

from collections.abc import Sequence

from dreampipe.scheduling.actions import Action, ActionKind, ScheduleKind

__all__ = ["zero_bubble_counts", "zero_bubble_order"]

_F, _B, _W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


def zero_bubble_counts(
    kind: ScheduleKind, warmup: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(w_s, d_s)`` per stage for ``kind`` (module doc), from 1F1B's in-flight counts
    ``warmup`` (:func:`~dreampipe.planning.in_flight.in_flight_counts` with no join)."""
    top = warmup[0]
    if kind is ScheduleKind.ZB_H1:
        return tuple(warmup), tuple(max(0, top - w) for w in warmup)
    assert kind is ScheduleKind.ZB_H2, kind
    return tuple(2 * w - 1 for w in warmup), tuple(max(0, 2 * (top - w)) for w in warmup)


def zero_bubble_order(units: list[int], warmup: int, defer: int, stage: int) -> list[Action]:
    """One replica's minibatch: ``warmup`` forwards, then ``B``, the ``W`` put off by
    ``defer`` microbatches and the next ``F``; the ``W`` left over at the end."""
    w = min(warmup, len(units))
    acts = [Action(_F, stage, u) for u in units[:w]]
    done = 0
    for j, u in enumerate(units):
        acts.append(Action(_B, stage, u))
        if j >= defer:
            acts.append(Action(_W, stage, units[done]))
            done += 1
        if j + w < len(units):
            acts.append(Action(_F, stage, units[j + w]))
    acts += [Action(_W, stage, u) for u in units[done:]]
    return acts

"""The walks along one rank's actions that correct the memory formula's peak."""

from __future__ import annotations

from dreampipe.runtime.memory_walks import gradients_later
from dreampipe.scheduling.actions import Action, ActionKind


def _acts(text: str, stage: int = 0) -> tuple[Action, ...]:
    """Actions of one rank from ``"F0 F1 B0 A B1 S"``: F, B, W with their microbatch,
    A an ``ALLREDUCE``, S a ``STEP``."""
    kinds = {"F": ActionKind.FORWARD, "B": ActionKind.BACKWARD, "W": ActionKind.WEIGHT,
             "A": ActionKind.ALLREDUCE, "S": ActionKind.STEP}
    return tuple(Action(kinds[w[0]], stage, int(w[1:] or 0)) for w in text.split())


def test_gradients_exist_from_an_update_s_first_backward_to_its_step() -> None:
    """The formula holds the gradients (4 or 15 bytes) beside its most microbatches in
    flight (10 bytes each); a rank holds them only from its update's first backward,
    which frees that microbatch's tensors as it makes them, to its ``STEP``. What the
    formula counts beyond the rank's peak, by hand:"""
    # all forwards first: the peak is the 2 in flight (20) without gradients, or at the
    # first backward the other one and the larger of its tensors and the gradients
    assert gradients_later(_acts("F0 F1 B0 B1 S"), 10, 4) == 20 + 4 - 20
    assert gradients_later(_acts("F0 F1 B0 B1 S"), 10, 15) == 20 + 15 - (10 + 15)
    # a forward after a backward of the same update holds both: the formula's peak
    assert gradients_later(_acts("F0 F1 B0 F2 B1 B2 S"), 10, 4) == 0
    # a STEP frees them: the next update's forward holds its tensors alone
    assert gradients_later(_acts("F0 B0 S F1 B1 S"), 10, 4) == 10 + 4 - 10
    # a split backward releases at W; after the first stage W holds B's graph besides
    assert gradients_later(_acts("F0 F1 B0 W0 B1 W1 S"), 10, 4) == 4
    assert gradients_later(_acts("F0 F1 B0 W0 B1 W1 S", 1), 10, 15, stage=1) == 0
    # the all-reduce buckets, made as the round's last backward ends: beyond the formula
    assert gradients_later(_acts("F0 F1 B0 B1 A S"), 10, 4, buckets=30) == 24 - 34

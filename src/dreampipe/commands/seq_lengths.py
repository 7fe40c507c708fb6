"""``dreampipe train --seq-lengths MIN:MAX``: token sequences of a new length every step,
and what a length not met before costs against one met already.

Step ``k``'s minibatch is the dataset's, its sequences (input and target) cut to a length
drawn from ``MIN..MAX`` under ``(seed, k)``, the same on every rank; the model is built
for ``MAX`` tokens, so its profile, plan and memory prediction are of the longest. The
Pipeline declares dimension 1 variable (``TrainConfig.variable_dims``). Rank 0 times each
``Pipeline.step``, which under a synchronous schedule returns once its minibatch went
through every stage and back; the report gives the median time of the steps whose length
is new and of those whose length came before. The first step, which also warms the run
up, counts in neither.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from dreampipe.api.config import TrainConfig
from dreampipe.errors import ConfigError
from dreampipe.models.spec import ModelSpec

__all__ = ["check_token_model", "cut", "length_times", "lengths_line", "longest_note",
           "parse_lengths", "step_length", "with_lengths"]


def parse_lengths(text: str | None) -> tuple[int, int] | None:
    """``--seq-lengths MIN:MAX`` as ``(MIN, MAX)`` (None: not given)."""
    if text is None:
        return None
    low, colon, high = text.partition(":")
    if colon and low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high):
        return int(low), int(high)
    raise ConfigError(f"--seq-lengths {text}: write MIN:MAX, whole numbers with 1 <= MIN <= "
                      "MAX, e.g. --seq-lengths 8:64", "seq_lengths")


def longest_note(lengths: str | None) -> str:
    """What a throughput prediction under ``--seq-lengths MIN:MAX`` is of: the longest
    sequences, which its profile and plan are of (module doc); "" without the flag."""
    if lengths is None:
        return ""
    low, _, high = lengths.partition(":")
    return f"; predicted for the longest sequences, {high} tokens, where the steps drew {low} " \
        f"to {high}"


def with_lengths(config: TrainConfig, lengths: str | None) -> TrainConfig:
    """``config`` with the sequence dimension (1) variable where ``--seq-lengths`` is given."""
    if lengths is None or 1 in config.variable_dims:
        return config
    return dataclasses.replace(config, variable_dims=(*config.variable_dims, 1))


def step_length(seed: int, step: int, lengths: tuple[int, int]) -> int:
    """Step ``step``'s sequence length, drawn from ``lengths`` (both ends included)."""
    return random.Random(seed * 1_000_003 + step).randint(*lengths)


def cut(batch: tuple[Tensor, Tensor], length: int) -> tuple[Tensor, Tensor]:
    """``batch``'s input and target cut to their first ``length`` tokens (dimension 1)."""
    x, y = batch
    return x[:, :length], y[:, :length] if y.dim() > 1 else y


def check_token_model(spec: ModelSpec, lengths: tuple[int, int]) -> None:
    """``spec`` must take ``[batch, tokens]`` of integers, ``lengths[1]`` tokens at least."""
    probe = spec.sample_input(1)
    if probe.dim() != 2 or probe.is_floating_point() or probe.shape[1] < lengths[1]:
        raise ConfigError(
            f"--seq-lengths {lengths[0]}:{lengths[1]} cuts token sequences of [batch, tokens] "
            f"integers, {lengths[1]} tokens at most; model {spec.name} takes {probe.dtype} "
            f"{list(probe.shape)}: use a token model such as transformer, built for "
            f"--model-arg seq_len={lengths[1]} at least", "seq_lengths")


def length_times(lengths: Sequence[int], step_s: Sequence[float]) -> dict[str, Any]:
    """The median seconds of the steps of a new length and of a repeated one (after the
    first step), with their counts (None: no such step)."""
    new: list[float] = []
    again: list[float] = []
    seen = set(lengths[:1])
    for length, seconds in zip(lengths[1:], step_s[1:], strict=True):
        (again if length in seen else new).append(seconds)
        seen.add(length)
    return {"new_length_step_s": statistics.median(new) if new else None,
            "repeated_length_step_s": statistics.median(again) if again else None,
            "new_length_steps": len(new), "repeated_length_steps": len(again),
            "lengths": list(lengths)}


def lengths_line(times: dict[str, Any]) -> str:
    """:func:`length_times`' medians as the line ``dreampipe train`` prints."""
    def median(key: str) -> str:
        return "-" if times[key] is None else f"{1e3 * times[key]:.1f} ms"

    return (f"step time by sequence length (rank 0, first step aside): new length "
            f"{median('new_length_step_s')} ({times['new_length_steps']} steps), repeated "
            f"{median('repeated_length_step_s')} ({times['repeated_length_steps']} steps)")

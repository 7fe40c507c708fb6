"""Recomputation: a stage that keeps only its inputs and runs its forward again in the
backward (the plan's ``r``, activation checkpointing for a whole stage).

The forward runs without a graph; the backward runs it again, on the same
weight version, then differentiates. The second run must compute what the
first did, so it replays what the forward read besides the weights:

- the random state (dropout draws the same masks), CPU and the device's;
- the autocast state the forward ran under;
- buffers: the second run reads them as the first did (a forward that reads a
  buffer it updates, an EMA, computes the same), and they are put back as they
  are afterwards, so they move once per microbatch, as without recomputation.

Its inputs it reads as they are kept: a first run that wrote them in place
(``ReLU(inplace=True)`` first thing) would leave the second another input, so
that is a ConfigError (:func:`check_inputs_kept`), not a wrong gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from dreampipe.errors import ConfigError

__all__ = ["Replay", "check_inputs_kept", "record", "replay"]


@dataclass
class Replay:
    """What a forward read besides its inputs and weights."""

    cpu_rng: Tensor
    cuda_rng: Tensor | None
    device: torch.device
    autocast: torch.dtype | None
    buffers: list[Tensor]
    #: The forward's input tensors, each with its version counter as it began.
    inputs: list[tuple[Tensor, int]]


def record(device: torch.device, module: nn.Module, inputs: object = None) -> Replay:
    """Taken just before ``module``'s forward on ``inputs`` that will be recomputed."""
    cuda = device.type == "cuda"
    cast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(
        device.type) else None
    kept = [(t, t._version) for t in tree_leaves(inputs) if isinstance(t, Tensor)]
    return Replay(torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None,
                  device, cast, [b.detach().clone() for b in module.buffers()], kept)


def check_inputs_kept(r: Replay, stage: int) -> None:
    """After the first run of a forward :func:`record` took: it must not have written its
    inputs, which the second run reads (a ConfigError naming the fix)."""
    if any(t._version != v for t, v in r.inputs):
        raise ConfigError(
            f"stage {stage}'s forward writes its input in place (an in-place op on what it "
            "is given, such as ReLU(inplace=True) or x.sub_() first thing), and the stage "
            "runs its forward again in its backward (a recomputing stage, or stash=False), "
            "where it would read the written input: make that op out of place, or plan the "
            "stage without recomputation", "plan")


def replay(r: Replay, module: nn.Module, forward: Callable[[], Any]) -> Any:
    """``forward()`` again as it first ran: its random state, autocast and ``module``'s
    buffers, which are restored afterwards to their values now."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    with torch.no_grad():
        for (b, _), then in zip(buffers, r.buffers, strict=True):
            b.data.copy_(then)
    cuda = [r.device.index or 0] if r.cuda_rng is not None else []
    cast = torch.autocast(r.device.type, r.autocast) if r.autocast is not None else nullcontext()
    with torch.random.fork_rng(devices=cuda):
        torch.set_rng_state(r.cpu_rng)
        if r.cuda_rng is not None:
            torch.cuda.set_rng_state(r.cuda_rng, r.device)
        with torch.enable_grad(), cast:
            out = forward()
    for b, saved in buffers:  # through .data: the graph saved them (BatchNorm's running
        b.data.copy_(saved)   # statistics), and a visible in-place write would void it
    return out

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
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Replay", "record", "replay"]


@dataclass
class Replay:
    """What a forward read besides its inputs and weights."""

    cpu_rng: Tensor
    cuda_rng: Tensor | None
    device: torch.device
    autocast: torch.dtype | None
    buffers: list[Tensor]


def record(device: torch.device, module: nn.Module) -> Replay:
    """Taken just before ``module``'s forward that will be recomputed."""
    cuda = device.type == "cuda"
    cast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(
        device.type) else None
    return Replay(torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None,
                  device, cast, [b.detach().clone() for b in module.buffers()])


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

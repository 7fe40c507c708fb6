"""Evaluation: run a forward-only schedule with the current weights, no autograd.

The ranks execute :func:`~dreampipe.scheduling.build.forward_only`'s action
lists in order (``RECV_F F SEND_F``), over the same links as training; the
last stage scores each unit: its loss times its samples and, when the
targets are class labels (an integer tensor that ``output.argmax(1)`` can be
compared with), the labels it got right.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dreampipe.runtime.comm import Comm
from dreampipe.runtime.engine import UnitData
from dreampipe.scheduling.actions import ActionKind, Schedule

__all__ = ["UnitScore", "run_forwards"]


@dataclass(frozen=True)
class UnitScore:
    """One unit on the last stage: summed loss, samples, right labels, labels (0: none)."""

    loss_sum: float
    samples: int
    correct: int
    labels: int


def _score(out: object, y: Tensor, loss: Tensor) -> UnitScore:
    n = int(y.shape[0]) if y.dim() else 1
    if (isinstance(out, Tensor) and not y.is_floating_point() and out.dim() == y.dim() + 1
            and out.shape[:1] + out.shape[2:] == y.shape):
        return UnitScore(float(loss) * n, n, int((out.argmax(1) == y).sum()), y.numel())
    return UnitScore(float(loss) * n, n, 0, 0)


def run_forwards(
    schedule: Schedule, rank: int, module: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor],
    data: UnitData | None, comm: Comm, autocast: torch.dtype | None = None,
) -> dict[int, UnitScore]:
    """Execute ``schedule.actions[rank]``; the scores of the units this rank ended."""
    stage = schedule.stage_of_rank(rank)
    last = stage == schedule.num_stages - 1
    inputs: dict[int, Any] = {}
    outputs: dict[int, Tensor] = {}
    scores: dict[int, UnitScore] = {}
    device = comm.device
    cast = torch.autocast(device.type, autocast) if autocast is not None else nullcontext()
    with torch.no_grad(), cast:
        for a in schedule.actions[rank]:
            if a.kind is ActionKind.RECV_F:
                inputs[a.unit] = comm.take(a)[0]
            elif a.kind is ActionKind.SEND_F:
                comm.send(a, outputs.pop(a.unit))
            elif a.kind is ActionKind.FORWARD:
                assert data is not None or not (stage == 0 or last)
                x = data.inputs(a.unit) if stage == 0 and data is not None else inputs.pop(a.unit)
                out = module(*x) if isinstance(x, tuple) else module(x)
                if last:
                    assert data is not None
                    y = data.targets(a.unit)
                    scores[a.unit] = _score(out, y, loss_fn(out, y))
                else:
                    outputs[a.unit] = out
    comm.drain()
    return scores

"""Evaluation: run a forward-only schedule with the current weights, no autograd.

The ranks execute :func:`~dreampipe.scheduling.build.forward_only`'s action
lists in order (``RECV_F F SEND_F``), over the same links as training; the
last stage scores each microbatch: its loss times its samples and, when the
targets are class labels (an integer tensor that ``output.argmax(1)`` can be
compared with), the labels it got right.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dreampipe.runtime.comm import Comm
from dreampipe.runtime.precision import Precision
from dreampipe.runtime.stage_records import MicrobatchData
from dreampipe.scheduling.actions import ActionKind, Schedule

__all__ = ["Count", "MicrobatchScore", "item_count", "run_forwards"]

#: What a microbatch's mean loss averages over: a mask of its targets, True where counted
#: (the targets not ``ignore_index``).
Count = Callable[[Tensor], Tensor]


def item_count(count: Count | None, target: Tensor) -> float:
    """The items ``target``'s mean loss averages over: ``count``'s, else its samples."""
    if count is not None:
        return float(count(target).sum())
    return float(target.shape[0]) if target.dim() else 1.0


@dataclass(frozen=True)
class MicrobatchScore:
    """One microbatch on the last stage: summed loss, samples, right labels, labels (0: none)."""

    loss_sum: float
    samples: float
    correct: int
    labels: int


def _predicted(out: object, y: Tensor) -> Tensor | None:
    """The class ``out`` picks for each label of ``y``: scores ``[B, C, ...]``, the layout
    ``cross_entropy`` takes; None where ``[..., C]`` fits too (``[B, T, C]`` with ``T ==
    C``: the class axis is unknown). ``[B, T, C]`` itself scores nothing: a loss that
    reshapes it may also shift the labels (a causal language model's), which the
    output's shape does not say."""
    if not isinstance(out, Tensor) or y.is_floating_point() or out.dim() != y.dim() + 1:
        return None
    first = out.shape[:1] + out.shape[2:] == y.shape
    last = out.dim() > 2 and out.shape[:-1] == y.shape
    return out.argmax(1) if first and not last else None


def _score(out: object, y: Tensor, loss: Tensor, count: Count | None) -> MicrobatchScore:
    n = item_count(count, y)
    total = float(loss) * n if n else 0.0  # nothing counted: its loss (NaN) is no item's
    picked = _predicted(out, y)
    if picked is None:
        return MicrobatchScore(total, n, 0, 0)
    kept = torch.ones_like(y, dtype=torch.bool) if count is None else count(y)
    return MicrobatchScore(total, n, int(((picked == y) & kept).sum()), int(kept.sum()))


def run_forwards(
    schedule: Schedule, rank: int, modules: Mapping[int, nn.Module],
    loss_fn: Callable[[Tensor, Tensor], Tensor], data: MicrobatchData | None,
    comms: Mapping[int, Comm], precision: Precision = Precision.FP32,
    count: Count | None = None,
) -> dict[int, MicrobatchScore]:
    """Execute ``schedule.actions[rank]`` with the rank's module and :class:`Comm` of
    each stage it runs (several under interleaving), in the number formats of
    ``precision`` as training runs them; the scores of the microbatches it ended, each
    loss weighed by ``count`` of its targets (the samples by default)."""
    last = schedule.num_stages - 1
    inputs: dict[tuple[int, int], Any] = {}
    outputs: dict[tuple[int, int], Tensor] = {}
    scores: dict[int, MicrobatchScore] = {}
    device = next(iter(comms.values())).device
    with torch.no_grad(), precision.forwards(device.type):
        for a in schedule.actions[rank]:
            key = (a.stage, a.microbatch)
            if a.kind is ActionKind.RECV_F:
                inputs[key] = comms[a.stage].take(a)[0]
            elif a.kind is ActionKind.SEND_F:
                comms[a.stage].send(a, outputs.pop(key))
            elif a.kind is ActionKind.FORWARD:
                assert data is not None or a.stage not in (0, last)
                x = (precision.model_inputs(data.inputs(a.microbatch))
                     if a.stage == 0 and data is not None else inputs.pop(key))
                module = modules[a.stage]
                out = module(*x) if isinstance(x, tuple) else module(x)
                if a.stage == last:
                    assert data is not None
                    y = data.targets(a.microbatch)
                    out = precision.loss_input(out)
                    scores[a.microbatch] = _score(out, y, loss_fn(out, y), count)
                else:
                    outputs[key] = precision.sent(out)
    for comm in comms.values():
        comm.drain()
    return scores

"""One process training in a run's number formats, written from docs/design.md §5.5, not
from the runtime's code, to compare pipelines with:

- ``fp32``: plain training;
- ``bf16-mixed``, ``fp16-mixed``: every forward and its loss under ``torch.autocast``;
  fp16 with ``torch.amp.GradScaler`` (its initial scale and growth interval given);
- ``bf16``: 32-bit master copies of the initial weights; the model in bf16, its
  floating inputs cast to bf16 and its output to fp32 before the loss; gradients
  accumulate in bf16, the optimizer steps the masters, the model takes their rounding.

Gradient accumulation as :func:`runtime.reference.reference_sync`: update ``k`` sums the
gradients of its ``microbatches`` slices, each of mean loss ``1 / microbatches``.
The returned state holds the masters' values for the parameters under ``bf16``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from dreampipe.models.datasets import Dataset
from dreampipe.models.spec import ModelSpec

from .reference import OptFactory

__all__ = ["FormatsRun", "reference_formats"]

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


@dataclass(frozen=True)
class FormatsRun:
    """The losses of each update, the final state and the updates a GradScaler skipped."""

    losses: list[float]
    state: dict[str, Tensor]
    skipped: list[int]


def _cast(x: Any, dtype: torch.dtype) -> Any:
    def one(v: Any) -> Any:
        return v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() else v

    if isinstance(x, dict) and type(x) is not dict:  # a ModelOutput keeps its attributes
        return type(x)(**{k: one(v) for k, v in x.items()})
    return pytree.tree_map(one, x)


def reference_formats(spec: ModelSpec, data: Dataset, *, steps: int, minibatch: int, seed: int,
                      opt: OptFactory, microbatches: int, precision: str,
                      loss_scale: float = 2.0**16, window: int = 2000,
                      skip: tuple[int, ...] = ()) -> FormatsRun:
    """``steps`` updates of ``spec``'s model in ``precision`` (module docstring); the
    updates ``skip`` lists are dropped (as a GradScaler drops one that overflowed)."""
    size = minibatch // microbatches
    model = spec.build(0, spec.num_layers - 1, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    pure = precision == "bf16"
    masters = [nn.Parameter(p.detach().float().clone()) for p in params] if pure else params
    if pure:
        model.to(torch.bfloat16)
    optimizer = opt(masters)
    cast = _AUTOCAST.get(precision)
    scaler = (torch.amp.GradScaler("cpu", init_scale=loss_scale, growth_interval=window)
              if precision == "fp16-mixed" else None)
    losses, skipped = [], []
    for k in range(steps):
        for p in (*params, *masters):
            p.grad = None
        total = 0.0
        for m in range(microbatches):
            x, y = data.batch(k * microbatches + m, size)
            with torch.autocast("cpu", cast or torch.bfloat16, enabled=cast is not None):
                out = model(_cast(x, torch.bfloat16) if pure else x)
                loss = spec.loss_fn(_cast(out, torch.float32) if pure else out, y)
            share = loss * (1.0 / microbatches)
            (scaler.scale(share) if scaler is not None else share).backward()
            total += float(loss.detach())
        losses.append(total / microbatches)
        if k in skip:
            skipped.append(k)
            continue
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < before:
                skipped.append(k)
            continue
        if pure:
            for p, master in zip(params, masters, strict=True):
                master.grad = None if p.grad is None else p.grad.float()
        optimizer.step()
        if pure:
            with torch.no_grad():
                for p, master in zip(params, masters, strict=True):
                    p.copy_(master)
    full = {id(p): master for p, master in zip(params, masters, strict=True)}
    state = {k: full.get(id(v), v).detach().clone()
             for k, v in model.state_dict(keep_vars=True).items()}
    return FormatsRun(losses, state, skipped)

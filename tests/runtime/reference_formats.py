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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from dreampipe.models.datasets import Dataset
from dreampipe.models.spec import ModelSpec

__all__ = ["Formats", "FormatsRun", "reference_formats"]

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
OptFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


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


class Formats:
    """A precision's rules for the references' modules (the module docstring): forwards
    under autocast (the mixed ones), or a module in bf16 stepped through fp32 masters."""

    def __init__(self, precision: str = "fp32", device: str = "cpu") -> None:
        self.precision, self.device = precision, device
        self.pure = precision == "bf16"
        self._masters: dict[int, tuple[list[nn.Parameter], list[nn.Parameter]]] = {}

    def optimizer(self, module: nn.Module, opt: OptFactory) -> torch.optim.Optimizer:
        """``opt`` on ``module``'s trained parameters, or on fp32 masters of them (the
        module then moves to bf16)."""
        params = [p for p in module.parameters() if p.requires_grad]
        if not self.pure:
            return opt(params)
        masters = [nn.Parameter(p.detach().float().clone()) for p in params]
        module.to(torch.bfloat16)
        self._masters[id(module)] = (params, masters)
        return opt(masters)

    @contextmanager
    def forwards(self) -> Iterator[None]:
        cast = _AUTOCAST.get(self.precision)
        with torch.autocast(torch.device(self.device).type, cast or torch.bfloat16,
                            enabled=cast is not None):
            yield

    def inputs(self, x: Any) -> Any:
        return _cast(x, torch.bfloat16) if self.pure else x

    def output(self, out: Any) -> Any:
        return _cast(out, torch.float32) if self.pure else out

    def step(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step with the gradients on ``module``'s parameters."""
        if not self.pure:
            optimizer.step()
            return
        params, masters = self._masters[id(module)]
        for p, master in zip(params, masters, strict=True):
            master.grad = None if p.grad is None else p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)

    def state(self, module: nn.Module) -> dict[str, Tensor]:
        """``module``'s state, its parameters the masters' values."""
        params, masters = self._masters.get(id(module), ([], []))
        full = {id(p): m for p, m in zip(params, masters, strict=True)}
        return {k: full.get(id(v), v).detach().to("cpu", copy=True)
                for k, v in module.state_dict(keep_vars=True).items()}


def reference_formats(spec: ModelSpec, data: Dataset, *, steps: int, minibatch: int, seed: int,
                      opt: OptFactory, microbatches: int, precision: str,
                      loss_scale: float = 2.0**16, window: int = 2000,
                      skip: tuple[int, ...] = (), device: str = "cpu") -> FormatsRun:
    """``steps`` updates of ``spec``'s model in ``precision`` (module docstring) on
    ``device``, whose kernels and autocast rules a run on it meets too; the updates
    ``skip`` lists are dropped (as a GradScaler drops one that overflowed). The state
    returned is on the CPU."""
    size = minibatch // microbatches
    model = spec.build(0, spec.num_layers - 1, seed).to(device)
    formats = Formats(precision, device)
    optimizer = formats.optimizer(model, opt)
    scaler = (torch.amp.GradScaler(torch.device(device).type, init_scale=loss_scale,
                                   growth_interval=window)
              if precision == "fp16-mixed" else None)
    losses, skipped = [], []
    for k in range(steps):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(microbatches):
            x, y = pytree.tree_map(
                lambda v: v.to(device) if isinstance(v, Tensor) else v,
                data.batch(k * microbatches + m, size))
            with formats.forwards():
                loss = spec.loss_fn(formats.output(model(formats.inputs(x))), y)
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
        formats.step(model, optimizer)
    return FormatsRun(losses, formats.state(model), skipped)

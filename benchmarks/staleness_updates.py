"""How a stage of ``staleness.py``'s delayed-update model takes its update.

The update rules of issue 43's candidates that change the step rather than
the weights a microbatch runs on: PACI's local accumulation and the
error-feedback step (:class:`StepState`), PipeMare's learning-rate
rescheduling (:func:`anneal`) and PipeNAG's optimizer (:func:`optimizer`);
and the copies of a weight two stages share (:func:`untie`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["StepState", "anneal", "optimizer", "untie"]

_NAG_TOP = 0.99  # PipeNAG's momentum for a delay of a whole pipeline


class StepState:
    """Each stage's gradients summed since its last update (PACI's local accumulation
    when its window is more than 1) and its last step (for error feedback)."""

    def __init__(self, stages: int) -> None:
        self.sums: list[dict[Tensor, Tensor]] = [{} for _ in range(stages)]
        self.count = [0] * stages
        self.last: list[list[Tensor] | None] = [None] * stages

    def restart(self) -> None:
        self.last = [None] * len(self.last)

    def add(self, s: int, p: Tensor, g: Tensor) -> None:
        self.sums[s][p] = self.sums[s][p] + g if p in self.sums[s] else g

    def ready(self, s: int, window: int) -> bool:
        self.count[s] += 1
        return self.count[s] >= window

    def step(self, s: int, opt: torch.optim.Optimizer, sched: Any, factor: float,
             feedback: int) -> None:
        """Update stage ``s`` with its mean gradient, its learning rate times ``factor``;
        ``feedback`` (its delay; 0: off): add ``d`` times the change of its step."""
        params = list(self.sums[s])
        for p in params:
            p.grad = self.sums[s][p] / self.count[s]
        before = [p.detach().clone() for p in params] if feedback else []
        for group in opt.param_groups:
            group["lr"] *= factor
        opt.step()
        for group in opt.param_groups:
            group["lr"] /= factor
        if sched is not None:
            sched.step()
        if feedback:
            step = [p.detach() - b for p, b in zip(params, before, strict=True)]
            prev = self.last[s]
            if prev is not None:
                with torch.no_grad():
                    for p, now, old in zip(params, step, prev, strict=True):
                        p.add_(now - old, alpha=feedback)
            self.last[s] = step
        self.sums[s] = {}
        self.count[s] = 0


def anneal(delay: int, t: int, per_epoch: int) -> float:
    """PipeMare's learning-rate rescheduling: ``d ** -(1 - min(t / K, 1))``, ``K`` one
    epoch's minibatches (1 for a stage without delay)."""
    return float(max(1, delay) ** -(1 - min(t / per_epoch, 1.0)))


def optimizer(build: Callable[[list[Tensor]], torch.optim.Optimizer], params: list[Tensor],
              nesterov: float | None) -> torch.optim.Optimizer:
    """The user's optimizer ``build(params)``; with ``nesterov`` (a stage's delay over the
    number of stages), its Nesterov form with the momentum raised toward 0.99 by that
    fraction of the way (PipeNAG's adaptive momentum: NAdam with decoupled weight decay
    for AdamW, SGD with ``nesterov=True``)."""
    params = params or [nn.Parameter(torch.zeros(0))]  # a stage of ReLUs updates nothing
    opt = build(params)
    if nesterov is None:
        return opt
    group = opt.param_groups[0]
    if "betas" in group:
        b1, b2 = group["betas"]
        return torch.optim.NAdam(params, lr=group["lr"], eps=group["eps"],
                                 betas=(b1 + nesterov * (_NAG_TOP - b1), b2),
                                 weight_decay=group["weight_decay"],
                                 decoupled_weight_decay=True)
    mu = group["momentum"]
    return torch.optim.SGD(params, lr=group["lr"], nesterov=True,
                           momentum=mu + nesterov * (_NAG_TOP - mu))


def untie(stages: list[nn.Sequential]) -> list[tuple[int, str, int, str]]:
    """Give a later stage its own copy of a weight an earlier stage holds too (GPT-2's
    tied head): ``(stage, name, owner stage, owner's name)`` for each copy. The owner's
    optimizer updates it with both gradients summed; the copy is set to the result."""
    seen: dict[int, tuple[int, str]] = {}
    ties = []
    for s, m in enumerate(stages):
        for name, p in list(m.named_parameters(remove_duplicate=False)):
            owner = seen.setdefault(id(p), (s, name))
            if owner[0] != s:
                path, _, leaf = name.rpartition(".")
                setattr(m.get_submodule(path), leaf, nn.Parameter(p.detach().clone()))
                ties.append((s, name, *owner))
    return ties

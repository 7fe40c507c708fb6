"""Single-process models of what a dreampipe run must compute (docs/design.md §5).

Written from the design's rules, not from the runtime's code, so the runtime's
tests can catch it doing something else:

- synchronous schedules (GPipe, 1F1B-flush, data parallel, naive): one
  model, one optimizer step per minibatch on the mean loss of the minibatch,
  accumulated over its microbatches in order;
- PipeDream's asynchronous 1F1B with weight stashing: stage ``s`` runs
  minibatch ``t`` (forward and backward) with the version of its weights
  after ``max(0, t // r_s - K_s + 1)`` of its updates, where ``K_s`` is the
  number of minibatches a replica of stage ``s`` admits before its first
  backward (``n - s`` in a straight pipeline, so the versions used for ``t``
  are ``w_0^(t-n+1), ..., w_{n-1}^(t)``); each stage updates after every
  round of ``r_s`` minibatches with the mean of their gradients;
- vertical sync: every stage uses the input stage's version for ``t``;
- staleness compensation: a stage whose version for ``t`` is ``d`` updates
  behind trains with its SGD momentum lowered by ``d / (d + 1)`` (at least 0);
  an Adam stage keeps its settings and minibatch ``t`` runs on that version
  ``v`` extrapolated to the update its gradient goes into, ``k`` updates on:
  ``w_v + k (w_v - w_{v-1})``, where ``v >= 1`` (version 0 is the run's start);
- PipeDream-2BW: ``W(t+1) = W(t) - lr * grad f(W(t-1))`` with ``W(-1) = W(0)``:
  update ``t``'s gradient (accumulated over its microbatches as in the
  synchronous schedules) is taken at the weights of one update before, and
  the optimizer applies it to the newest weights;
- buffers (BatchNorm running statistics) are not versioned: every forward
  runs on the stage's live buffers and updates them, stage by stage in
  minibatch order (only parameters are passed to ``functional_call``). The
  reference holds one set of buffers per stage, so it models buffers only
  for stages of one replica.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from dreampipe.models.spec import ModelSpec
from dreampipe.runtime.data import Dataset

__all__ = ["OptFactory", "adam", "adamw", "admitted", "reference_pipedream", "reference_sync",
           "reference_two_bw", "sgd"]

OptFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def sgd(lr: float, momentum: float = 0.0) -> OptFactory:
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def adam(lr: float) -> OptFactory:
    return lambda params: torch.optim.Adam(params, lr=lr)


def adamw(lr: float) -> OptFactory:
    return lambda params: torch.optim.AdamW(params, lr=lr)


def reference_sync(
    spec: ModelSpec,
    data: Dataset,
    *,
    steps: int,
    minibatch: int,
    seed: int,
    opt: OptFactory,
    microbatches: int = 1,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[list[float], dict[str, Tensor]]:
    """Gradient accumulation: update k sums the gradients of its ``microbatches`` slices;
    ``scheduler`` (a learning-rate scheduler's factory) steps after every update;
    ``autocast``: each forward and its loss run under ``torch.autocast`` to that dtype.

    Update k covers samples ``k*minibatch ..``; microbatch ``m`` of it is unit
    ``k*microbatches + m`` of ``minibatch / microbatches`` samples, and its mean
    loss counts ``1 / microbatches`` (so the update is the gradient of the mean
    loss of the minibatch). Layers whose forward depends on the batch
    (BatchNorm) see one microbatch at a time and update their running
    statistics once per microbatch, in order. The loss of an update is the mean
    of its microbatch losses.
    """
    if minibatch % microbatches:
        raise ValueError(f"{microbatches} microbatches do not divide a minibatch of {minibatch}")
    size = minibatch // microbatches
    model = spec.build(0, spec.num_layers - 1, seed)
    optimizer = opt(list(model.parameters()))
    schedule = scheduler(optimizer) if scheduler is not None else None
    losses = []
    for k in range(steps):
        optimizer.zero_grad()
        losses.append(_accumulate(model, spec, data, k, microbatches, size, autocast))
        optimizer.step()
        if schedule is not None:
            schedule.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _accumulate(forward: Callable[[Tensor], Any], spec: ModelSpec, data: Dataset, k: int,
                microbatches: int, size: int, autocast: torch.dtype | None = None) -> float:
    """Update ``k``'s gradients summed over its microbatches (each of mean loss
    ``1 / microbatches``) by backward through ``forward``; the mean of their losses."""
    total = 0.0
    for m in range(microbatches):
        x, y = data.batch(k * microbatches + m, size)
        with torch.autocast("cpu", autocast, enabled=autocast is not None):
            loss = spec.loss_fn(forward(x), y)
        torch.autograd.backward(loss / microbatches)
        total += float(loss.detach())
    return total / microbatches


def reference_two_bw(
    spec: ModelSpec,
    data: Dataset,
    *,
    steps: int,
    minibatch: int,
    seed: int,
    opt: OptFactory,
    microbatches: int = 1,
    compensate: bool = False,
) -> tuple[list[float], dict[str, Tensor]]:
    """PipeDream-2BW's update rule on one model: update ``t`` takes the gradient at the
    weights after ``t - 1`` updates (the first two at the start's), summed over its
    microbatches of mean loss ``1 / microbatches`` each, and steps the newest weights.
    ``compensate``: the delay of 1 lowers SGD's momentum by 1/2 (at least 0); under
    Adam, from update 2 on the gradient is taken at ``W(t-1) + (W(t-1) - W(t-2))``."""
    size = minibatch // microbatches
    model = spec.build(0, spec.num_layers - 1, seed)
    optimizer = opt(list(model.parameters()))
    predicting = compensate and _compensate(optimizer, 1)
    history: list[dict[str, Tensor]] = []
    losses = []
    for t in range(steps):
        history.append(_snapshot(model))
        v = max(t - 1, 0)
        stale = {k: w.requires_grad_(True)
                 for k, w in _predicted(history, v, t - v if predicting else 0).items()}
        losses.append(_accumulate(lambda x, w=stale: functional_call(model, w, (x,)), spec, data, t,
                                  microbatches, size))
        for name, p in model.named_parameters():
            p.grad = stale[name].grad
        optimizer.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def admitted(replicas: Sequence[int], stage: int) -> int:
    """Minibatches a replica of ``stage`` starts before its first backward: PipeDream's
    ``ceil(W / r)`` (docs/design.md §5) plus the join buffer, two per replica beyond one of
    this and later stages, except at the last stage (``docs/design.md`` §5.2)."""
    joins = 0 if stage == len(replicas) - 1 else sum(r - 1 for r in replicas[stage:])
    return math.ceil((sum(replicas[stage:]) + 2 * joins) / replicas[stage])


def reference_pipedream(
    spec: ModelSpec,
    data: Dataset,
    *,
    bounds: Sequence[int],
    replicas: Sequence[int],
    steps: int,
    minibatch: int,
    seed: int,
    opt: OptFactory,
    vertical_sync: bool = False,
    partial_round: bool = False,
    ties: Sequence[Sequence[tuple[int, str]]] = (),
    compensate: bool = False,
) -> tuple[list[float], dict[str, Tensor]]:
    """PipeDream's delayed updates; returns per-minibatch losses and the final weights.

    ``compensate``: each stage's SGD momentum is lowered by its delay's ``d / (d + 1)``;
    with ``ties``, every stage's by the deepest delay's (the copies take the same updates).
    ``partial_round``: a run that ends inside a replicated stage's round still
    updates with the mean of that round's minibatches (``Pipeline.finish``).
    ``ties``: groups of ``(stage, parameter name)`` that are one weight of the model,
    a copy on each of those stages (of one replica): minibatch ``t``'s gradient of each
    copy is the sum over the group, so the copies take the same updates.
    """
    edges = [*bounds, spec.num_layers]
    n = len(replicas)
    stages = [spec.build(edges[s], edges[s + 1] - 1, seed) for s in range(n)]
    optims = [opt(list(m.parameters())) for m in stages]
    predicting = [compensate and _compensate(
        o, admitted(replicas, 0 if vertical_sync or ties else s) - 1) for s, o in enumerate(optims)]
    history: list[list[dict[str, Tensor]]] = [[_snapshot(m)] for m in stages]
    pending: list[list[list[Tensor]]] = [[] for _ in range(n)]

    def version(s: int, t: int) -> int:
        return max(0, t // replicas[s] - admitted(replicas, s) + 1)

    losses = []
    for t in range(steps):
        x, y = data.batch(t, minibatch)
        leaves = []
        for s in range(n):
            v = version(0, t) if vertical_sync else version(s, t)
            assert v < len(history[s]), f"stage {s} has no version {v} yet at minibatch {t}"
            ahead = t // replicas[s] - v if predicting[s] else 0
            params = {k: w.requires_grad_(True)
                      for k, w in _predicted(history[s], v, ahead).items()}
            leaves.append(params)
            x = functional_call(stages[s], params, (x,))
        loss = spec.loss_fn(x, y)
        losses.append(float(loss.detach()))
        flat = [p for params in leaves for p in params.values()]
        grads = list(torch.autograd.grad(loss, flat))
        index = {(s, k): i for i, (s, k) in enumerate(
            (s, k) for s, params in enumerate(leaves) for k in params)}
        for group in ties:
            total = torch.stack([grads[index[member]] for member in group]).sum(0)
            for member in group:
                grads[index[member]] = total
        for s in range(n):
            count = len(leaves[s])
            pending[s].append(grads[:count])
            grads = grads[count:]
            if len(pending[s]) == replicas[s] or (partial_round and t == steps - 1
                                                   and pending[s]):
                mean = [torch.stack(gs).mean(0) for gs in zip(*pending[s], strict=True)]
                for p, g in zip(_trainable(stages[s]), mean, strict=True):
                    p.grad = g
                optims[s].step()
                pending[s].clear()
                history[s].append(_snapshot(stages[s]))
    state: dict[str, Tensor] = {}
    for m in stages:
        state.update({k: v.detach().clone() for k, v in m.state_dict().items()})
    return losses, state


def _compensate(optimizer: torch.optim.Optimizer, d: int) -> bool:
    """Compensate a delay of ``d``: lower SGD's momentum by ``d / (d + 1)`` (at least 0)
    and return False; or, for Adam, keep its settings and return True (it predicts)."""
    if d == 0:
        return False
    if any("betas" in g for g in optimizer.param_groups):
        return True
    for group in optimizer.param_groups:
        group["momentum"] = max(0.0, group["momentum"] - d / (d + 1))
    return False


def _predicted(history: list[dict[str, Tensor]], v: int, ahead: int) -> dict[str, Tensor]:
    """Version ``v`` extrapolated ``ahead`` updates by the update that made it (a copy)."""
    if ahead <= 0 or v == 0:
        return {k: w.clone() for k, w in history[v].items()}
    return {k: w + ahead * (w - history[v - 1][k]) for k, w in history[v].items()}


def _snapshot(module: nn.Module) -> dict[str, Tensor]:
    """The trained (``requires_grad``) parameters' values: frozen ones take no updates."""
    return {k: p.detach().clone() for k, p in module.named_parameters() if p.requires_grad}


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]

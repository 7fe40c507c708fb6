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
- clipping (``max_grad_norm``): an update's gradient, summed over a tied weight's copies,
  is scaled by ``max_norm / (norm + 1e-6)`` where that is below 1, the norm taken over
  every weight once (``torch.nn.utils.clip_grad_norm_`` on the one model);
- staleness compensation: a stage whose version for ``t`` is ``d`` updates
  behind trains with its SGD momentum lowered by ``d / (d + 1)`` (at least 0);
  an Adam stage keeps its settings and minibatch ``t`` runs on that version
  ``v`` extrapolated to the update its gradient goes into, ``k`` updates on:
  ``w_v + k (w_v - w_{v-1})``, where ``v >= 1`` (version 0 is the run's start);
- PipeDream-2BW: ``W(t+1) = W(t) - lr * grad f(W(t-1))`` with ``W(-1) = W(0)``:
  update ``t``'s gradient (accumulated over its microbatches as in the
  synchronous schedules) is taken at the weights of one update before, and
  the optimizer applies it to the newest weights;
- tensor-split stages (``split_as``, the run's plan): a Linear that a stage splits over
  ``t`` workers computes on the same shards as DTensor does there (see
  :func:`split_like`), so each of its reductions is cut where the run cuts it.
  Summing the ``k`` terms of a dot product in other pieces moves a float32 result by
  up to about ``k * 2**-24 * sum |a_i b_i|`` (Higham's bound), and which pieces the
  single-process kernel sums depends on the CPU's kernel set (``ATEN_CPU_CAPABILITY``):
  4 steps of a 2048-wide layer split by its inputs moved a bias of the mlp by 4.2e-5
  under AVX-512, past what the comparisons allow. Cut the same way, only the order in
  which the run's all-reduce adds the ``t`` partial sums remains: none for ``t = 2``
  (``a + b == b + a``), ``t - 1`` roundings of a few ulp otherwise;
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
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from dreampipe.models.datasets import Dataset
from dreampipe.models.spec import ModelSpec
from dreampipe.planning.plan import Plan
from dreampipe.planning.splits import Split

from .reference_formats import Formats

__all__ = ["OptFactory", "adam", "adamw", "admitted", "reference_pipedream", "reference_sync",
           "reference_two_bw", "sgd", "split_like"]

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
    split_as: Plan | None = None,
    max_grad_norm: float | None = None,
    norms: list[float] | None = None,
) -> tuple[list[float], dict[str, Tensor]]:
    """Gradient accumulation: update k sums the gradients of its ``microbatches`` slices;
    ``scheduler`` (a learning-rate scheduler's factory) steps after every update;
    ``autocast``: each forward and its loss run under ``torch.autocast`` to that dtype;
    ``split_as``: the layers this plan splits compute as :func:`split_like` says;
    ``max_grad_norm``: each update is clipped by its global norm, which ``norms`` (if
    given) gets, update by update, before the clip.

    Update k covers samples ``k*minibatch ..``; microbatch ``m`` of it is microbatch
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
    if split_as is not None:
        split_like(model, split_as, spec.layer_names)
    optimizer = opt(list(model.parameters()))
    schedule = scheduler(optimizer) if scheduler is not None else None
    losses = []
    for k in range(steps):
        optimizer.zero_grad()
        losses.append(_accumulate(model, spec, data, k, microbatches, size, autocast))
        _clip(list(model.parameters()), max_grad_norm, norms)
        optimizer.step()
        if schedule is not None:
            schedule.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _clip(params: list[nn.Parameter], max_grad_norm: float | None,
          norms: list[float] | None) -> None:
    """Clip the gradients of ``params`` (each weight once) by their global norm, appended
    to ``norms``; nothing without ``max_grad_norm``."""
    if max_grad_norm is not None:
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        if norms is not None:
            norms.append(norm)


def _accumulate(forward: Callable[[Tensor], Any], spec: ModelSpec, data: Dataset, k: int,
                microbatches: int, size: int, autocast: torch.dtype | Formats | None = None
                ) -> float:
    """Update ``k``'s gradients summed over its microbatches (each of mean loss
    ``1 / microbatches``) by backward through ``forward`` (under ``autocast``: a dtype, or a
    precision's forwards); the mean of their losses."""
    total = 0.0
    for m in range(microbatches):
        x, y = data.batch(k * microbatches + m, size)
        cast = autocast.forwards() if isinstance(autocast, Formats) else torch.autocast(
            "cpu", autocast or torch.bfloat16, enabled=autocast is not None)
        with cast:
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
    formats: Formats | None = None,
    max_grad_norm: float | None = None,
) -> tuple[list[float], dict[str, Tensor]]:
    """PipeDream-2BW's update rule on one model: update ``t`` takes the gradient at the
    weights after ``t - 1`` updates (the first two at the start's), summed over its
    microbatches of mean loss ``1 / microbatches`` each, and steps the newest weights.
    ``compensate``: the delay of 1 lowers SGD's momentum by 1/2 (at least 0); under
    Adam, from update 2 on the gradient is taken at ``W(t-1) + (W(t-1) - W(t-2))``.
    ``formats``: a precision's (:mod:`.reference_formats`); ``max_grad_norm`` (fp32):
    each update's gradient clipped by its global norm."""
    size = minibatch // microbatches
    model = spec.build(0, spec.num_layers - 1, seed)
    fm = formats or Formats()
    optimizer = fm.optimizer(model, opt)
    predicting = compensate and _compensate(optimizer, 1)
    history: list[dict[str, Tensor]] = []
    losses = []
    for t in range(steps):
        history.append(_snapshot(model))
        v = max(t - 1, 0)
        stale = {k: w.requires_grad_(True)
                 for k, w in _predicted(history, v, t - v if predicting else 0).items()}
        losses.append(_accumulate(
            lambda x, w=stale: fm.output(functional_call(model, w, (fm.inputs(x),))), spec,
            data, t, microbatches, size, fm))
        for name, p in model.named_parameters():
            p.grad = stale[name].grad
        _clip(list(model.parameters()), max_grad_norm, None)
        fm.step(model, optimizer)
    return losses, fm.state(model)


def admitted(replicas: Sequence[int], stage: int, join: int = 2,
             widths: Sequence[int] = ()) -> int:
    """Minibatches a replica of ``stage`` starts before its first backward: PipeDream's
    ``ceil(W / r)`` (docs/design.md §5) plus the join buffer, ``join`` per replica beyond
    one of this and later stages, except at the last stage; then, from the last stage up, each
    stage's total over its replicas raised until it leads the next stage's by ``r`` when
    both have ``r`` replicas, else by ``max(lcm, 2 max)`` of the two (§5.2). ``W`` counts
    every worker of the later stages, ``widths[s]`` for each replica of a split stage."""
    n = len(replicas)
    t = list(widths) or [1] * n
    total = []
    for s, r in enumerate(replicas):
        joins = 0 if s == n - 1 else sum(m - 1 for m in replicas[s:])
        later = sum(m * w for m, w in zip(replicas[s + 1:], t[s + 1:], strict=True))
        total.append(math.ceil((r + later + join * joins) / r) * r)
    for s in reversed(range(n - 1)):
        a, b = replicas[s], replicas[s + 1]
        lead = a if a == b else max(math.lcm(a, b), 2 * max(a, b))
        while total[s] < total[s + 1] + lead:
            total[s] += a
    return total[stage] // replicas[stage]


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
    split_as: Plan | None = None,
    formats: Formats | None = None,
    max_grad_norm: float | None = None,
) -> tuple[list[float], dict[str, Tensor]]:
    """PipeDream's delayed updates; returns per-minibatch losses and the final weights.
    ``formats``: a precision's (:mod:`.reference_formats`); ``max_grad_norm`` (stages
    replicated equally, so that all update together): each round's gradients, every
    stage's, clipped by their global norm, a tied weight counted once.

    ``compensate``: each stage's SGD momentum is lowered by its delay's ``d / (d + 1)``;
    with ``ties``, every stage's by the deepest delay's (the copies take the same updates).
    ``partial_round``: a run that ends inside a replicated stage's round still
    updates with the mean of that round's minibatches (``Pipeline.finish``).
    ``ties``: groups of ``(stage, parameter name)`` that are one weight of the model,
    a copy on each of those stages (of one replica): minibatch ``t``'s gradient of each
    copy is the sum over the group, so the copies take the same updates.
    ``split_as``: the layers this plan splits compute as :func:`split_like` says.
    """
    edges = [*bounds, spec.num_layers]
    n = len(replicas)
    stages = [spec.build(edges[s], edges[s + 1] - 1, seed) for s in range(n)]
    if split_as is not None:
        for stage in stages:
            split_like(stage, split_as, spec.layer_names)
    fm = formats or Formats()
    optims = [fm.optimizer(m, opt) for m in stages]
    # each stage's delay; under vertical sync the input stage's, with ties the deepest
    delays = [admitted(replicas, s) - 1 for s in range(n)]
    predicting = [compensate and _compensate(
        o, delays[0] if vertical_sync else max(delays) if ties else delays[s])
        for s, o in enumerate(optims)]
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
            with fm.forwards():
                x = functional_call(stages[s], params, (fm.inputs(x) if s == 0 else x,))
        with fm.forwards():
            loss = spec.loss_fn(fm.output(x), y)
        losses.append(float(loss.detach()))
        flat = [p for params in leaves for p in params.values()]
        grads = list(torch.autograd.grad(loss, flat))
        index = {(s, k): i for i, (s, k) in enumerate(
            (s, k) for s, params in enumerate(leaves) for k in params)}
        for group in ties:
            total = torch.stack([grads[index[member]] for member in group]).sum(0)
            for member in group:
                grads[index[member]] = total
        due: dict[int, list[Tensor]] = {}  # the stages that update now: their mean gradient
        for s in range(n):
            count = len(leaves[s])
            pending[s].append(grads[:count])
            grads = grads[count:]
            if len(pending[s]) == replicas[s] or (partial_round and t == steps - 1
                                                   and pending[s]):
                due[s] = [torch.stack(gs).mean(0) for gs in zip(*pending[s], strict=True)]
                pending[s].clear()
        if max_grad_norm is not None and due:
            _clip_stages(due, [list(params) for params in leaves], ties, max_grad_norm)
        for s, mean in due.items():
            for p, g in zip(_trainable(stages[s]), mean, strict=True):
                p.grad = g
            fm.step(stages[s], optims[s])
            history[s].append(_snapshot(stages[s]))
    state: dict[str, Tensor] = {}
    for m in stages:
        state.update(fm.state(m))
    return losses, state


def _clip_stages(due: dict[int, list[Tensor]], names: list[list[str]],
                 ties: Sequence[Sequence[tuple[int, str]]], max_grad_norm: float) -> None:
    """Scale every stage's gradient in ``due`` by ``max_grad_norm`` over their global norm
    (at most 1), each tied weight counted at its first copy only."""
    assert len(due) == len(names), "clipping takes every stage's update at once"
    again = {member for group in ties for member in group[1:]}
    sq = sum(float(g.double().pow(2).sum()) for s, mean in due.items()
             for name, g in zip(names[s], mean, strict=True) if (s, name) not in again)
    coef = min(1.0, max_grad_norm / (math.sqrt(sq) + 1e-6))
    for mean in due.values():
        for g in mean:
            g.mul_(coef)


def split_like(model: nn.Module, plan: Plan, names: Sequence[str]) -> None:
    """Make the Linears of ``model``'s layers (children named ``names[i]`` for the
    model's layer ``i``; those it lacks are skipped) that ``plan`` splits over ``t > 1``
    workers compute as a :class:`~dreampipe.runtime.tensor_split.SplitStage` does, on
    the same shards (``torch.chunk``'s, DTensor's ``Shard``), joined in worker order:

    - ``IN``: ``t`` partial products of the input's and the weight's column shards,
      each plus ``bias / t`` (DTensor's ``Replicate`` to ``Partial``), summed;
    - ``OUT``: the outputs of the weight's row shards, concatenated; the input's
      gradient is then the sum of their ``t`` partial gradients;
    - ``BATCH``: the batch's shards through the whole weight, concatenated; the
      weight's gradient is then the sum of their ``t`` partial gradients;
    - ``REPLICA``: unchanged.

    Each shard is a fresh tensor, as a DTensor's local shard is: a view at an
    offset into its whole may be computed by another kernel path (alignment),
    which rounds differently on some CPUs.

    Parameters keep their objects and names (``state_dict``, ``functional_call``).
    A layer split otherwise than ``REPLICA`` must be one Linear (and parameter-free
    modules), the layers :func:`~dreampipe.runtime.tensor_split.SplitStage` splits.
    """
    layers = dict(model.named_children())
    for stage in plan.stages:
        if stage.tensor_parallel == 1:
            continue
        for i, split in zip(range(stage.first, stage.last + 1), stage.splits, strict=True):
            layer = layers.get(names[i])
            if layer is None or split is Split.REPLICA:
                continue
            linears = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
            weighted = [n for n, m in layer.named_modules()
                        if next(m.parameters(recurse=False), None) is not None]
            if weighted != linears or len(linears) != 1:
                raise ValueError(f"layer {names[i]!r} split {split.value}: the reference "
                                 f"splits one Linear, not the weights of {weighted}")
            parent, _, key = (f"{names[i]}.{linears[0]}" if linears[0] else names[i]
                              ).rpartition(".")
            linear = model.get_submodule(parent).get_submodule(key)
            assert isinstance(linear, nn.Linear)
            setattr(model.get_submodule(parent), key,
                    _SplitLinear(linear, split, stage.tensor_parallel))


class _SplitLinear(nn.Module):
    """``linear``'s parameters, computed as :func:`split_like` says for ``split`` over
    ``t`` workers."""

    def __init__(self, linear: nn.Linear, split: Split, t: int) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.split, self.t = split, t

    def forward(self, x: Tensor) -> Tensor:
        w, b, t = self.weight, self.bias, self.t
        if self.split is Split.IN:
            share = None if b is None else b / t
            parts = [F.linear(xs.clone(), ws.clone(), share)
                     for xs, ws in zip(x.chunk(t, -1), w.chunk(t, 1), strict=True)]
            out = parts[0]
            for part in parts[1:]:
                out = out + part
            return out
        if self.split is Split.OUT:
            rows = w.chunk(t)
            biases: Sequence[Tensor | None] = [None] * len(rows) if b is None else b.chunk(t)
            return torch.cat([F.linear(x, ws.clone(), None if bs is None else bs.clone())
                              for ws, bs in zip(rows, biases, strict=True)], -1)
        assert self.split is Split.BATCH, self.split
        return torch.cat([F.linear(xs.clone(), w, b) for xs in x.chunk(t)])


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

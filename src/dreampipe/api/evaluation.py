"""A Pipeline's evaluation: forwards of held-out batches with the current weights.

Each run of batches of one shape is a forward-only schedule on the training
stages, all of a rank's where it runs several (the links agree on one shape per
run), scored on the last stage and summed over the world, so every rank gets
the same :class:`EvalResult`. Replicas of a stage keep their own buffers in training
(BatchNorm's running statistics); they evaluate with the first replica's, which
``full_state_dict`` holds, and get their own back after (:func:`first_replicas_buffers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dreampipe.api.checks import Batch
from dreampipe.api.feed import Batches
from dreampipe.errors import ConfigError
from dreampipe.runtime.comm import Comm
from dreampipe.runtime.forwards import Count, run_forwards
from dreampipe.runtime.precision import Precision
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import forward_only
from dreampipe.splitter.segments import eval_refusal

__all__ = ["EvalRank", "EvalResult", "all_reduced", "check_evaluable", "evaluate",
           "first_replicas_buffers"]


@dataclass(frozen=True)
class EvalResult:
    """Mean loss per sample (per target counted, with ``ignore_index``); top-1 accuracy
    when the targets are class labels."""

    loss: float
    accuracy: float | None


@dataclass(frozen=True, kw_only=True)
class EvalRank:
    """What of a Pipeline's rank an evaluation runs on."""

    replicas: list[int]
    srank: int
    reports: bool  # the first worker of a split stage's replica scores
    device: torch.device
    timeout_s: float
    links: Any
    precision: Precision
    virtual_stages: int = 1
    #: The training schedule, whose placement of several stages per rank the forwards keep.
    kind: ScheduleKind = ScheduleKind.GPIPE
    #: Whether every message carries its shape (``RunnerOptions.varying_shapes``).
    varying: bool = False


def check_evaluable(layers: Sequence[tuple[str, nn.Module]]) -> None:
    """A model of ``layers`` must run in eval mode for evaluate() (:func:`eval_refusal`)."""
    refused = eval_refusal(layers)
    if refused is not None:
        raise ConfigError(
            f"evaluate() cannot run the model in eval mode: {refused}; move that branch "
            "into the forward of a submodule the forward calls (a block runs whole, in "
            "its own mode), or evaluate full_state_dict() in one process", "model")


def evaluate(batches: Sequence[Batch], modules: dict[int, nn.Module],
             loss_fn: Callable[..., Tensor], me: EvalRank,
             count: Count | None = None) -> EvalResult:
    """Forwards of ``batches`` through this rank's ``modules``, by stage (eval mode for
    the while); each batch's loss weighed by ``count`` of its targets (its samples by
    default). Every rank of the world calls it."""
    if not batches:  # a mean over nothing: no loss is 0.0
        raise ConfigError("evaluate() was given no batches; give at least one (x, y)",
                          "loader")
    totals = torch.zeros(4, dtype=torch.float64)
    start = 0
    while start < len(batches):
        end = start + 1
        while end < len(batches) and _shapes(batches[end]) == _shapes(batches[start]):
            end += 1
        sched = forward_only(me.replicas, end - start, me.virtual_stages, me.kind)
        box: dict[tuple[int, int, int], Tensor] = {}
        comms = {s: Comm(sched, me.srank, me.device, me.timeout_s, groups=me.links,
                         evaluation=True, stage=s, mailbox=box, varying=me.varying)
                 for s in modules}
        modes = [(sub, sub.training) for module in modules.values() for sub in module.modules()]
        for module in modules.values():
            module.eval()
        try:
            scores = run_forwards(sched, me.srank, modules, loss_fn,
                                  Batches(list(batches[start:end]), me.device), comms,
                                  me.precision, count)
        finally:
            for sub, training in modes:  # as the user left each: a frozen BatchNorm stays so
                sub.training = training
        for s in scores.values() if me.reports else ():
            totals += torch.tensor([s.loss_sum, s.samples, s.correct, s.labels],
                                   dtype=torch.float64)
        start = end
    loss_sum, samples, correct, labels = all_reduced(totals, me.device).tolist()
    return EvalResult(loss_sum / max(samples, 1), correct / labels if labels else None)


@contextmanager
def first_replicas_buffers(modules: dict[int, nn.Module], *, replicated: bool, first: bool
                           ) -> Iterator[None]:
    """While it lasts, every replica of a stage holds its first replica's buffers (where
    ``first``, this rank's are those); its own come back after. ``replicated``: some stage
    of the plan has replicas, the same on every rank (a collective over the world)."""
    if not replicated:
        yield
        return
    mine = {s: {k: b.detach().cpu() for k, b in m.named_buffers()}
            for s, m in modules.items()} if first else None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    theirs: dict[int, dict[str, Tensor]] = {}
    for part in gathered:
        theirs.update(part or {})
    kept = {s: {k: b.clone() for k, b in m.named_buffers()} for s, m in modules.items()}
    try:
        _load_buffers(modules, theirs)
        yield
    finally:
        _load_buffers(modules, kept)


def _load_buffers(modules: dict[int, nn.Module], values: dict[int, dict[str, Tensor]]
                  ) -> None:
    """Each stage's buffers take ``values``' (by stage, then by name)."""
    with torch.no_grad():
        for s, m in modules.items():
            for k, b in m.named_buffers():
                b.copy_(values[s][k])


def all_reduced(values: Tensor, device: torch.device) -> Tensor:
    """``values`` summed over the world, back on the CPU; the sum runs on ``device``, the
    rank's own (NCCL reduces only tensors on the rank's GPU)."""
    on_device = values.to(device)
    dist.all_reduce(on_device)
    return on_device.cpu()


def _shapes(batch: Batch) -> list[tuple[int, ...]]:
    x, y = batch
    xs = tuple(x.values()) if isinstance(x, dict) else x if isinstance(x, tuple) else (x,)
    return [tuple(t.shape) for t in (*xs, y)]

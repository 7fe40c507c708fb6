"""A rank's copies of weights tied across stages: one value, one summed gradient.

The rule (DeepSpeed's ``TiedLayerSpec``; GPT-2's embedding and head): every copy starts
from the first stage's value (:func:`start_values`, before the stages cast to 16 bits or
shard, so the 32-bit master weights start from the value itself), and each update,
before its global norm is taken, sums the copies' gradients: the copies a rank holds
(two under interleaving) first, then over the ranks holding the others, so every copy
applies the same change (where no copy was used, none takes a gradient). On a replicated
stage one replica adds the stage's sum (the replicas hold it: the rank's ``ALLREDUCE``
of every stage precedes its first ``STEP``) and the others zeros. Where a stage's
replicas shard their gradients (ZeRO level 2 and up, :mod:`.zero`), the replica's chunks
are gathered whole for the sum and cut again after it. docs/design.md §8.4.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dreampipe.runtime.stage_module import StageModule

__all__ = ["RankTie", "TiedCopy", "left_out_of_norm", "start_values", "sum_ties"]


@dataclass(frozen=True)
class TiedCopy:
    """Parameter ``index`` of ``module`` is a copy of a tied weight. ``counts``: this
    replica adds its stage's gradient (else zeros); ``normed``: the global norm counts the
    tie's gradient here (its first stage's copy), and not at the other copies."""

    module: StageModule
    index: int
    counts: bool
    normed: bool


@dataclass(frozen=True)
class RankTie:
    """One tie as a rank holds it: its ``copies``, in stage order; ``group``: the ranks
    holding copies (None: this rank holds them all); ``src``: the rank every copy starts
    from."""

    copies: tuple[TiedCopy, ...]
    group: Any
    src: int


def start_values(ties: Sequence[tuple[Sequence[Tensor], Any, int]]) -> None:
    """Start each tie's copies on this rank, ``(params, group, src)``: the copies as the
    built stages hold them (in stage order, before any cast or shard), from rank ``src``'s
    first copy's value, broadcast over ``group`` (None: this rank holds them all); every
    rank holding a copy calls it, with the ties in one order."""
    with torch.no_grad():
        for params, group, src in ties:
            value = params[0].detach()
            if group is not None:
                sent = value.contiguous()
                dist.broadcast(sent, src=src, group=group)
                if sent.data_ptr() != value.data_ptr():
                    value.copy_(sent)
            for p in params[1:]:
                p.copy_(value)


def sum_ties(ties: Sequence[RankTie], wait: Callable[[Any], None]) -> None:
    """Give every copy its tie's gradient summed over the copies (each stage's once): this
    rank's counting copies added, then all-reduced over the group, with a flag of whether
    any copy was used; where none was, no copy gets a gradient, so weight decay and
    momentum leave the weight be, as in one process. ``wait`` waits for an all-reduce
    (the runner's, with the run's deadline)."""
    for tie in ties:
        used = any(c.module.tied_used(c.index) for c in tie.copies if c.counts)
        grads = [c.module.tied_gradient(c.index) for c in tie.copies]
        counted = [g for g, c in zip(grads, tie.copies, strict=True) if c.counts]
        total = torch.zeros_like(grads[0]) if not counted else counted[0]
        for g in counted[1:]:
            total = total + g
        if tie.group is not None:
            flag = torch.tensor([float(used)], device=total.device)
            works = [dist.all_reduce(t, group=tie.group, async_op=True) for t in (total, flag)]
            for work in works:
                wait(work)
            used = bool(flag.item() > 0)
        for k, c in enumerate(tie.copies):  # each its own tensor: clipping scales each once
            c.module.keep_tied(c.index, None if not used else total if k == 0 else total.clone())


def left_out_of_norm(ties: Sequence[RankTie]) -> set[tuple[int, int]]:
    """The ``(stage, parameter index)`` of the copies the global norm leaves out: it
    counts each tied weight once, at its first stage."""
    return {(c.module.stage, c.index) for tie in ties for c in tie.copies if not c.normed}

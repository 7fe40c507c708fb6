"""A stage's weights tied to copies on other stages: one value, one summed gradient.

The rule (DeepSpeed's ``TiedLayerSpec``; GPT-2's embedding and head): every copy starts
from the first stage's value, and each update all-reduces the copy's gradient over the
tie's group before the step, so every copy applies the same change. On a replicated stage
one replica adds the stage's sum (the replicas already hold it) and the others zeros. On a
stage whose replicas shard their gradients (ZeRO level 2 and up, :mod:`.zero`), the
replica's chunks are gathered whole for the sum and cut again after it; under level 3 the
starting value is broadcast into the weights gathered for the while and taken into the
chunks. docs/design.md §5.6.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dreampipe.runtime.precision import MasterWeights
from dreampipe.runtime.zero import ZeroShards
from dreampipe.runtime.zero_params import ZeroParams

__all__ = ["Tie", "start_tied", "sum_tied"]


@dataclass(frozen=True)
class Tie:
    """Parameter ``index`` is tied over ``group``; ``counts``: this replica adds its
    stage's gradient (else zeros)."""

    index: int
    group: Any
    counts: bool


def start_tied(params: Sequence[nn.Parameter], names: Sequence[str],
               master: MasterWeights | ZeroShards, tie: Tie, src: int) -> None:
    """Start ``tie``'s parameter from rank ``src``'s value (a broadcast over the tie's
    group, into the weights, or under level 3 into a tensor of its own), and its master or
    chunk from it."""
    p = params[tie.index]
    freed = isinstance(master, ZeroParams) and not master.whole
    value = torch.empty_like(p, memory_format=torch.contiguous_format) if freed else p.data
    dist.broadcast(value, src=src, group=tie.group)
    master.load({names[tie.index]: value}, names)


def sum_tied(ties: Sequence[Tie], params: Sequence[nn.Parameter],
             sums: list[Tensor | None], zero: ZeroShards | None,
             wait: Callable[[Any], None] | None) -> None:
    """Sum each tied gradient over its group: in ``sums`` (by parameter, None: none came),
    or in ``zero``'s chunks where the stage shards its gradients. ``wait`` waits for an
    all-reduce (None: the work's own ``wait``)."""
    for tie in ties:
        i = tie.index
        g = sums[i] if zero is None else zero.whole_gradient(i)
        g = torch.zeros_like(params[i]) if g is None or not tie.counts else g
        work = dist.all_reduce(g, group=tie.group, async_op=True)
        if wait is None:
            work.wait()
        else:
            wait(work)
        if zero is None:
            sums[i] = g
        else:
            zero.keep_gradient(i, g)

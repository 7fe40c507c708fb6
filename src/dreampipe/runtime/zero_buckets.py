"""ZeRO level 2's gradient sums: each microbatch's gradient reduce-scattered over the
replicas, bucket by bucket as its backward finishes them.

The rule (Rajbhandari et al. 2020, §5.2; DeepSpeed's stage 2 with gradient accumulation):
a replica never holds a stage's whole gradient. When a parameter's gradient of one
microbatch is final, its ``r`` chunks go into its bucket's reduce-scatter input (replica
``j``'s row: chunk ``j``) and the gradient is freed; a full bucket starts its
reduce-scatter (``async_op``), and once done, the summed chunk is added to this replica's
sum for the update. At most two buckets are whole at a time (one filling, one on its way).
Buckets start strictly in order, so the replicas' collectives pair up; a replica that ran
fewer microbatches in a round than another joins the missing reduce-scatters with zeros at
the round's ``ALLREDUCE`` (the counts come from the schedule). Sending each microbatch
instead of once per update costs ``m`` reduce-scatters an update, each half an all-reduce:
that is the price of never holding the whole gradient. docs/design.md §5.6.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dreampipe.runtime.buckets import GradientBuckets, Wait
from dreampipe.runtime.zero import ZeroShards
from dreampipe.scheduling.actions import Action, ActionKind, Schedule

__all__ = ["ShardBuckets", "gradient_rounds", "stage_buckets"]


def gradient_rounds(schedule: Schedule, stage: int) -> list[int]:
    """For each all-reduce round of ``stage`` (its ``ALLREDUCE`` actions in order), the most
    microbatch gradients any of its replicas completes in it: its ``B`` actions, or its
    ``W`` where the schedule splits the backward."""
    done = ActionKind.WEIGHT if schedule.kind.splits_backward else ActionKind.BACKWARD
    most: list[int] = []
    for rank, acts in enumerate(schedule.actions):
        if stage not in schedule.stages_of_rank(rank):
            continue
        k = count = 0
        for a in acts:
            if a.stage != stage:
                continue
            if a.kind is done:
                count += 1
            elif a.kind is ActionKind.ALLREDUCE:
                most += [0] * (k + 1 - len(most))
                most[k] = max(most[k], count)
                k, count = k + 1, 0
    return most


class ShardBuckets:
    """Level 2's gradient sums for one replica of a stage (module docstring).

    :meth:`ready` takes each parameter's gradient of a microbatch as it becomes final,
    :meth:`settle` ends the microbatch (its reduce-scatters waited for, summed in),
    :meth:`scatter` does both for a whole gradient at once, and :meth:`finish`, at the
    round's ``ALLREDUCE``, joins the rounds this replica lacks and hands the sums, scaled,
    to ``shards``. ``rounds``: :func:`gradient_rounds` of the stage.
    """

    def __init__(self, shards: ZeroShards, wait: Wait, rounds: Sequence[int]) -> None:
        self._shards = shards
        self._wait = wait
        self._layout = shards.layout
        self._rounds = list(rounds)
        self._device = shards.masters[0].device if shards.masters else None
        self._sums: list[Tensor | None] = [None] * len(self._layout.numel)
        self._done = 0  # microbatches summed in this round
        self._round = 0  # the round's index in the schedule
        self._begin()

    @property
    def group(self) -> Any:
        """The process group of the stage's replicas."""
        return self._shards.group

    def _begin(self) -> None:
        """A microbatch's buckets, none started."""
        buckets = self._layout.buckets
        self._bufs: list[Tensor | None] = [None] * len(buckets)
        self._missing = [len(b.indices) for b in buckets]
        self._seen = [[False] * len(b.indices) for b in buckets]
        self._next = 0
        self._flying: list[tuple[int, Tensor, Any]] = []

    def ready(self, index: int, grad: Tensor) -> None:
        """Parameter ``index``'s gradient of the microbatch is final: into its bucket, and
        every bucket that can now start, in order, starts."""
        b, k = self._layout.where[index]
        if self._seen[b][k]:
            raise RuntimeError(f"parameter {index}'s gradient was reported twice in one "
                               "microbatch")
        bucket, lay = self._layout.buckets[b], self._layout
        buf = self._bufs[b]
        if lay.lies_whole(bucket) and grad.is_contiguous():  # chunks rank-major: no copy
            self._bufs[b] = grad.view(lay.replicas, bucket.size)
        else:
            if buf is None:
                buf = self._bufs[b] = torch.zeros(lay.replicas, bucket.size,
                                                  dtype=bucket.dtype, device=grad.device)
            lay.put(buf, bucket, k, grad)
        self._seen[b][k] = True
        self._missing[b] -= 1
        while self._next < len(self._bufs) and self._missing[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int, zeros: Tensor | None = None) -> None:
        buf = self._bufs[b] if zeros is None else zeros
        assert buf is not None
        self._bufs[b] = None
        out = torch.empty(self._layout.buckets[b].size, dtype=buf.dtype, device=buf.device)
        work = dist.reduce_scatter_single(out, buf.view(-1), group=self._shards.group,
                                          async_op=True)
        if self._flying:  # the one before is surely done by now: sum it, free its input
            self._add(*self._flying.pop(0), None)
        self._flying.append((b, out, (work, buf)))

    def _add(self, b: int, out: Tensor, started: tuple[Any, Tensor], action: Action | None
             ) -> None:
        """Wait for bucket ``b``'s reduce-scatter and add its chunks to the sums."""
        self._wait(started[0], action or Action(ActionKind.ALLREDUCE, self._shards.stage, 0))
        bucket, lay = self._layout.buckets[b], self._layout
        for i, off in zip(bucket.indices, bucket.offsets, strict=True):
            part = out[off:off + lay.hi[i] - lay.lo[i]]
            s = self._sums[i]
            self._sums[i] = part if s is None else s.add_(part)

    def settle(self, action: Action) -> None:
        """End the microbatch: every bucket reported (or a RuntimeError), each summed in."""
        if self._next < len(self._bufs):
            b = self._next
            raise RuntimeError(f"stage {self._shards.stage}'s backward at {action} left "
                               f"{self._missing[b]} gradients of bucket {b} unreported")
        for flying in self._flying:
            self._add(*flying, action)
        self._done += 1
        self._begin()

    def scatter(self, grads: Sequence[Tensor], action: Action) -> None:
        """A microbatch's whole gradient at once (``grads`` by parameter), then :meth:`settle`."""
        for i, g in enumerate(grads):
            self.ready(i, g)
        self.settle(action)

    def finish(self, action: Action, scale: float) -> None:
        """The round's ``ALLREDUCE``: join the reduce-scatters of the microbatches other
        replicas ran and this one did not (zeros), then hand the sums times ``scale`` to
        the shards."""
        lay = self._layout
        want = self._rounds[self._round % len(self._rounds)] if self._rounds else 0
        while self._done < want:
            for b, bucket in enumerate(lay.buckets):
                self._launch(b, torch.zeros(lay.replicas * bucket.size, dtype=bucket.dtype,
                                            device=self._device))
            self._next = len(lay.buckets)
            self.settle(action)
        sums = [s if s is not None else torch.zeros(
            lay.hi[i] - lay.lo[i], dtype=lay.buckets[lay.where[i][0]].dtype, device=self._device)
            for i, s in enumerate(self._sums)]
        if scale != 1.0:
            for s in sums:
                s.mul_(scale)
        self._shards.take_gradients(sums)
        self._sums = [None] * len(lay.numel)
        self._done = 0
        self._round += 1


def stage_buckets(shards: ZeroShards | None, params: Sequence[Tensor], group: Any,
                  wait: Wait, schedule: Schedule, stage: int
                  ) -> GradientBuckets | ShardBuckets:
    """What a runner's ``ALLREDUCE`` finishes for ``stage`` with ``shards`` (None: no ZeRO):
    its microbatches' reduce-scatters at level 2, an all-reduce otherwise; binds ``shards``
    to ``group``."""
    if shards is None:
        return GradientBuckets(params, group, wait)
    shards.bind(group, wait)
    if not shards.shards_gradients:
        return GradientBuckets(params, group, wait)
    return ShardBuckets(shards, wait, gradient_rounds(schedule, stage))

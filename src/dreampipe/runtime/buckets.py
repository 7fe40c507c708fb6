"""Gradient buckets all-reduced while the backward that completes a round still runs.

What DDP does: the replicas of a stage sum their gradients in *buckets* of
about :data:`BUCKET_CAP_MB` each, and a bucket's all-reduce starts
(``async_op=True``) as soon as its gradients are final, so the communication
of the late layers overlaps the backward of the early ones. Buckets start
strictly in one order fixed by the parameters (about their reverse registration
order), each once it and every bucket before it is ready, so every replica
issues the same collectives in the same order.
A gradient of half a bucket or more is a bucket of its own, all-reduced where
it lies; only the smaller ones are packed into flat copies (DDP copies every
gradient), so a replicated stage holds no second copy of its large gradients.
The ``ALLREDUCE`` action starts what is left, waits, scales and copies the
packed sums back: the result of one all-reduce over all the gradients
(docs/design.md §5.3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dreampipe.scheduling.actions import Action, ActionKind

__all__ = ["BUCKET_CAP_MB", "GradientBuckets", "in_place", "round_ends"]

#: Bucket size in MB (1e6 bytes), as DDP's ``bucket_cap_mb``. Below DDP's
#: 25: the planner prices each layer's gradient as going out once that
#: layer's backward is done (:func:`dreampipe.planning.costs.allreduce_end`),
#: and a layer of a few MB or more is then a bucket of its own, as priced.
BUCKET_CAP_MB = 4.0

#: ``wait(work, action)``: wait for an all-reduce, raising an error that names ``action``.
Wait = Callable[[Any, Action], None]


@dataclass
class _Bucket:
    indices: list[int]
    grads: list[Tensor | None]
    missing: int = 0
    flat: Tensor | None = None
    work: Any = None
    shared: bool = False


class GradientBuckets:
    """The all-reduce of one stage's gradients over ``group``, in buckets of ``cap_mb``.

    ``params[i]`` is the parameter of gradient index ``i``. Call :meth:`ready`
    once per index as its gradient becomes final, then :meth:`finish` at the
    ``ALLREDUCE`` action. ``cap_mb`` None takes :data:`BUCKET_CAP_MB` as it
    is at the call (tests shrink it to get many buckets out of a small model). A
    gradient :func:`in_place` is a bucket of its own; the others are packed in
    reverse order into a bucket that closes once it holds ``cap_mb`` or more, or at a
    change of dtype, and starts in that order as its last gradient comes.
    """

    def __init__(
        self, params: Sequence[Tensor], group: Any, wait: Wait, cap_mb: float | None = None
    ) -> None:
        self.group = group
        self._wait = wait
        self._buckets: list[_Bucket] = []
        cap = (BUCKET_CAP_MB if cap_mb is None else cap_mb) * 1e6
        packing: _Bucket | None = None  # the bucket small gradients are packed into
        size = 0.0
        for i in reversed(range(len(params))):
            p = params[i]
            nbytes = p.numel() * p.element_size()
            if in_place(nbytes, cap):
                self._buckets.append(_Bucket([i], []))
                continue
            if packing is not None and params[packing.indices[0]].dtype != p.dtype:
                self._buckets.append(packing)
                packing = None
            if packing is None:
                packing, size = _Bucket([], []), 0.0
            packing.indices.append(i)
            size += nbytes
            if size >= cap:
                self._buckets.append(packing)
                packing = None
        if packing is not None:
            self._buckets.append(packing)
        self._where = [(0, 0)] * len(params)
        for b, bucket in enumerate(self._buckets):
            for k, i in enumerate(bucket.indices):
                self._where[i] = (b, k)
        self._next = 0  # the first bucket not started yet
        self._reset()

    @property
    def sizes(self) -> list[int]:
        """The number of parameters in each bucket, in launch order."""
        return [len(b.indices) for b in self._buckets]

    def _reset(self) -> None:
        for b in self._buckets:
            b.grads = [None] * len(b.indices)
            b.missing = len(b.indices)
            b.flat = b.work = None
        self._next = 0

    def ready(self, index: int, grad: Tensor) -> None:
        """Gradient ``index`` is final: start every bucket that can now start, in order."""
        b, k = self._where[index]
        bucket = self._buckets[b]
        if bucket.grads[k] is None:
            bucket.missing -= 1
        bucket.grads[k] = grad
        while self._next < len(self._buckets) and self._buckets[self._next].missing == 0:
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        grads = [g for g in bucket.grads if g is not None]  # all of them: none is missing
        whole = _dense_view(grads[0]) if len(grads) == 1 else None
        if whole is not None:
            bucket.flat, bucket.shared = whole, True
        else:
            bucket.flat, bucket.shared = torch.cat([g.reshape(-1) for g in grads]), False
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def launch(self, grads: Sequence[Tensor]) -> None:
        """Start every bucket not started yet: ``grads`` are the stage's gradients by
        index, those not yet reported ready taken from here (all of them on a replica
        that ran no backward in the round)."""
        for i, g in enumerate(grads):
            b, k = self._where[i]
            if self._buckets[b].grads[k] is None:
                self.ready(i, g)

    def finish(self, grads: Sequence[Tensor], action: Action, scale: float) -> None:
        """Sum every gradient over the replicas in place, then multiply by ``scale``.

        ``grads`` as :meth:`launch` takes them (empty once launched). Waits name
        ``action``.
        """
        try:
            self.launch(grads)
            for bucket in self._buckets:
                self._wait(bucket.work, action)
                assert bucket.flat is not None
                if scale != 1.0:
                    bucket.flat.mul_(scale)
                if bucket.shared:
                    continue
                offset = 0
                for grad in bucket.grads:
                    assert grad is not None
                    n = grad.numel()
                    grad.copy_(bucket.flat[offset : offset + n].view_as(grad))
                    offset += n
        finally:
            self._reset()


def in_place(nbytes: float, cap_bytes: float | None = None) -> bool:
    """Whether a gradient of ``nbytes`` is a bucket of its own, all-reduced where it lies:
    half a bucket or more (``cap_bytes``, default :data:`BUCKET_CAP_MB`), which packing
    would copy for at most one neighbour's company. Smaller ones are packed, a copy."""
    return nbytes >= (BUCKET_CAP_MB * 1e6 if cap_bytes is None else cap_bytes) / 2


def _dense_view(grad: Tensor) -> Tensor | None:
    """A flat view of every element of ``grad`` where its elements fill their storage
    span without gaps or overlaps in some order of its dimensions (contiguous, or
    channels-last, or transposed); None otherwise. The sum over replicas is elementwise,
    so the order the view reads them in does not matter."""
    order = sorted(range(grad.dim()), key=lambda d: (grad.stride(d), grad.size(d)),
                   reverse=True)
    laid = grad.permute(order)
    return laid.view(-1) if laid.is_contiguous() else None


def round_ends(actions: tuple[Action, ...]) -> frozenset[int]:
    """Microbatches whose ``BACKWARD`` is the last before the rank's next ``ALLREDUCE``."""
    ends: set[int] = set()
    last: int | None = None
    for a in actions:
        if a.kind is ActionKind.BACKWARD:
            last = a.microbatch
        elif a.kind is ActionKind.ALLREDUCE and last is not None:
            ends.add(last)
            last = None
    return frozenset(ends)

"""The minibatches a Pipeline is given, cut into the schedule's microbatches.

Minibatch ``n`` of a segment is microbatches ``n*U .. n*U+U-1`` (``U`` microbatches per
update, :class:`~dreampipe.scheduling.microbatch_layout.MicrobatchLayout`), microbatch ``j`` being
samples ``j*size .. (j+1)*size-1`` of it, as in the built-in datasets. A minibatch of
another size (``variable_dims`` with 0) is cut as ``torch.tensor_split`` cuts it, and
each microbatch's loss counts its share of the samples (:meth:`Feed.share`), so the
update is the gradient of the minibatch's mean loss. A rank keeps only what it will
read: inputs on the replica of the first stage that runs the microbatch, targets on the
replica of the last stage; each is dropped once read. With a ``loss_weight`` (from
``ignore_index``: :func:`ignoring`), a microbatch's loss counts the items it weighs of its
targets (the tokens a token-mean loss averages over), so the update is the gradient of
the mean over the minibatch's items, as one process taking the loss of the whole
minibatch (docs/training.md, "The loss").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from dreampipe.api.checks import Batch, Inputs, map_inputs
from dreampipe.errors import ConfigError
from dreampipe.runtime.forwards import Count, item_count

__all__ = ["Batches", "Feed", "ignoring"]

def ignoring(ignore_index: int | None) -> Count | None:
    """The count of ``TrainConfig.ignore_index``: the targets not equal to it (None: the
    samples count)."""
    if ignore_index is None:
        return None
    return lambda target: target != ignore_index


class Feed:
    """Microbatches of the given minibatches, as the runtime reads them (its ``MicrobatchData``)."""

    def __init__(
        self, *, microbatches_per_update: int, device: torch.device,
        wants_inputs: Callable[[int], bool], wants_targets: Callable[[int], bool],
        loss_weight: Count | None = None,
    ) -> None:
        self.microbatches_per_update = microbatches_per_update
        self.device = device
        self._wants_inputs, self._wants_targets = wants_inputs, wants_targets
        self._inputs: dict[int, Inputs] = {}
        self._targets: dict[int, Tensor] = {}
        self._shares: dict[int, float] = {}
        self._loss_weight = loss_weight

    def _cut(self, t: Tensor, start: int, end: int) -> Tensor:
        # a copy: the caller may reuse its batch tensor while this microbatch is still in flight
        return t[start:end].to(self.device, copy=True)

    def add(self, index: int, batch: Batch) -> None:
        """Minibatch ``index`` of the segment."""
        x, y = batch
        per, size = self.microbatches_per_update, int(y.shape[0])
        bounds = [_split_at(size, per, j) for j in range(per + 1)]
        counts = [item_count(self._loss_weight, y[bounds[j]:bounds[j + 1]]) for j in range(per)]
        total = sum(counts)
        if self._loss_weight is not None and min(counts) <= 0:
            j = counts.index(min(counts))
            raise ConfigError(f"microbatch {j} of the segment's minibatch {index} has no target "
                              "to count, every one ignored (ignore_index), so its mean loss "
                              "is NaN; spread the ignored targets over the minibatch, or cut "
                              "it into fewer microbatches", "ignore_index")
        for j in range(per):
            u, start, end = index * per + j, bounds[j], bounds[j + 1]
            if counts[j] * per != total:
                self._shares[u] = counts[j] * per / total
            if self._wants_inputs(u):
                self._inputs[u] = map_inputs(x, functools.partial(self._cut, start=start,
                                                                  end=end))
            if self._wants_targets(u):
                self._targets[u] = self._cut(y, start, end)

    def share(self, microbatch: int) -> float:
        """What ``microbatch``'s loss counts beside the minibatch's other microbatches: its
        items (samples, or ``loss_weight``'s count) times the microbatches per update over
        the minibatch's (1 where they divide evenly)."""
        return self._shares.get(microbatch, 1.0)

    def inputs(self, microbatch: int) -> Inputs:
        """Microbatch ``microbatch``'s input (given once, read once)."""
        return self._inputs.pop(microbatch)

    def targets(self, microbatch: int) -> Tensor:
        """Microbatch ``microbatch``'s targets (given once, read once)."""
        return self._targets.pop(microbatch)


def _split_at(size: int, parts: int, j: int) -> int:
    """Where part ``j`` of ``size`` samples in ``parts`` begins, as ``torch.tensor_split``
    cuts: the first ``size % parts`` parts one sample larger."""
    small, large = divmod(size, parts)
    return j * small + min(j, large)


class Batches:
    """Whole batches as microbatches (evaluation: microbatch ``u`` is batch ``u``)."""

    def __init__(self, batches: list[Batch], device: torch.device) -> None:
        self._batches = batches
        self._device = device

    def inputs(self, microbatch: int) -> Inputs:
        """Batch ``microbatch``'s input."""
        return map_inputs(self._batches[microbatch][0], lambda t: t.to(self._device))

    def targets(self, microbatch: int) -> Tensor:
        """Batch ``microbatch``'s targets."""
        return self._batches[microbatch][1].to(self._device)

    def share(self, microbatch: int) -> float:
        """Each batch is whole: its loss counts once."""
        return 1.0

"""The minibatches a Pipeline is given, cut into the schedule's units.

Minibatch ``n`` of a segment is units ``n*U .. n*U+U-1`` (``U`` units per
update, :class:`~dreampipe.scheduling.units.UnitLayout`), unit ``j`` being
samples ``j*size .. (j+1)*size-1`` of it, as in the built-in datasets. A
rank keeps only what it will read: inputs on the replica of the first stage
that runs the unit, targets on the replica of the last stage; each is
dropped once read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from dreampipe.api.checks import Batch, Inputs, map_inputs

__all__ = ["Batches", "Feed"]


class Feed:
    """Units of the given minibatches, as the runtime reads them (its ``UnitData``)."""

    def __init__(
        self, *, unit_size: int, units_per_update: int, device: torch.device,
        wants_inputs: Callable[[int], bool], wants_targets: Callable[[int], bool],
    ) -> None:
        self.unit_size = unit_size
        self.units_per_update = units_per_update
        self.device = device
        self._wants_inputs, self._wants_targets = wants_inputs, wants_targets
        self._inputs: dict[int, Inputs] = {}
        self._targets: dict[int, Tensor] = {}

    def _cut(self, t: Tensor, j: int) -> Tensor:
        # a copy: the caller may reuse its batch tensor while this unit is still in flight
        return t[j * self.unit_size : (j + 1) * self.unit_size].to(self.device, copy=True)

    def add(self, index: int, batch: Batch) -> None:
        """Minibatch ``index`` of the segment."""
        x, y = batch
        for j in range(self.units_per_update):
            u = index * self.units_per_update + j
            if self._wants_inputs(u):
                self._inputs[u] = map_inputs(x, functools.partial(self._cut, j=j))
            if self._wants_targets(u):
                self._targets[u] = self._cut(y, j)

    def inputs(self, unit: int) -> Inputs:
        """Unit ``unit``'s input (given once, read once)."""
        return self._inputs.pop(unit)

    def targets(self, unit: int) -> Tensor:
        """Unit ``unit``'s targets (given once, read once)."""
        return self._targets.pop(unit)


class Batches:
    """Whole batches as units (evaluation: unit ``u`` is batch ``u``)."""

    def __init__(self, batches: list[Batch], device: torch.device) -> None:
        self._batches = batches
        self._device = device

    def inputs(self, unit: int) -> Inputs:
        """Batch ``unit``'s input."""
        return map_inputs(self._batches[unit][0], lambda t: t.to(self._device))

    def targets(self, unit: int) -> Tensor:
        """Batch ``unit``'s targets."""
        return self._batches[unit][1].to(self._device)

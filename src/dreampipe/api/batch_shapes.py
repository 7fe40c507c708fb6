"""The shapes a Pipeline's minibatches may take: the example's, but in the dimensions
``TrainConfig.variable_dims`` declares variable.

Every rank checks each minibatch the same way before anything is sent, so each raises
the same error at the same step. A minibatch that differs from the example in any other
dimension, dtype or structure is refused naming both shapes; with dimension 0 variable,
its tensors must agree on their samples, one a microbatch at least. The longest samples
and the largest microbatch met are kept for the memory prediction, which profiles on
them (docs/design.md §5.4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from dreampipe.api.checks import Batch, Inputs, map_inputs
from dreampipe.errors import DatasetError

__all__ = ["BatchShapes", "check_batch", "check_held_out"]


def _describe(t: Tensor) -> str:
    return f"{t.dtype} {list(t.shape)}"


def _signature(x: Inputs) -> list[str]:
    if isinstance(x, dict):
        return [f"{k}={_describe(t)}" for k, t in x.items()]
    return [_describe(t) for t in (x if isinstance(x, tuple) else (x,))]


def _tensors(x: Inputs) -> list[Tensor]:
    return list(x.values()) if isinstance(x, dict) else list(x) if isinstance(x, tuple) else [x]


def _fixed(x: Inputs, variable: Sequence[int]) -> list[tuple[object, ...]]:
    """What of ``x`` must equal the example's: names, dtypes and the sizes of the
    dimensions not in ``variable``."""
    names = list(x) if isinstance(x, dict) else [None] * len(_tensors(x))
    return [(name, type(x), t.dtype, tuple(-1 if d in variable else n
                                           for d, n in enumerate(t.shape)))
            for name, t in zip(names, _tensors(x), strict=True)]


def _sizes_differ(got: Batch, want: Batch, variable: Sequence[int]) -> list[int]:
    """The dimensions outside ``variable`` whose sizes alone set ``got`` apart from
    ``want`` (input and target); empty where names, dtypes or ranks differ too."""
    shapes: list[tuple[torch.Size, torch.Size]] = []
    for x, y in zip(got, want, strict=True):
        every = range(max((t.dim() for t in _tensors(x)), default=0))
        if _fixed(x, every) != _fixed(y, every):  # names, dtypes and ranks
            return []
        shapes += zip((t.shape for t in _tensors(x)), (t.shape for t in _tensors(y)),
                      strict=True)
    return sorted({d for m, n in shapes for d, (i, j) in enumerate(zip(m, n, strict=True))
                   if i != j and d not in variable})


def _fix(dims: Sequence[int], variable: Sequence[int]) -> str:
    """What to do about a minibatch unlike the example, given the ``dims`` that differ."""
    plain = ("give every step a minibatch shaped like example (a DataLoader with "
             "drop_last=True drops a short last batch)")
    if not dims:
        return plain
    declared = tuple(sorted({*variable, *dims}))
    named = ", ".join(str(d) for d in dims)
    return (f"{plain}; or, where dimension {named} may change from step to step (a "
            f"sequence's length, a batch's samples), declare it: "
            f"TrainConfig(variable_dims={declared!r})")


def _refuse_no_tensors(label: str, x: Inputs) -> None:
    """Every value of ``x`` (``label``: whose it is) must be a tensor (a DatasetError naming
    the first that is not, by position or key)."""
    names = list(x) if isinstance(x, dict) else range(len(_tensors(x)))
    for name, t in zip(names, _tensors(x), strict=True):
        if not isinstance(t, Tensor):
            raise DatasetError(
                f"{label} {name!r} is {type(t).__name__} {t!r:.40}, not a tensor; give every "
                "input a tensor with the samples first, as the example's")


def check_batch(index: int, batch: Batch, example: Batch, variable_dims: Sequence[int] = (),
                microbatches: int = 1) -> None:
    """Minibatch ``index`` must have the example's shapes and dtypes (input and target)
    but in ``variable_dims``; with 0 among them, one number of samples in all its
    tensors, at least ``microbatches``. Where only sizes differ, the error names the
    dimensions to declare."""
    for what, got, want in (("input", batch[0], example[0]), ("target", batch[1], example[1])):
        _refuse_no_tensors(f"minibatch {index}'s {what}", got)
        if _fixed(got, variable_dims) != _fixed(want, variable_dims):
            raise DatasetError(
                f"minibatch {index}'s {what} is {', '.join(_signature(got))} but example's is "
                f"{', '.join(_signature(want))}; "
                f"{_fix(_sizes_differ(batch, example, variable_dims), variable_dims)}"
            )
    if 0 not in variable_dims:
        return
    sizes = sorted({int(t.shape[0]) for t in (*_tensors(batch[0]), batch[1]) if t.dim()})
    if len(sizes) > 1:
        raise DatasetError(f"minibatch {index}'s tensors hold {sizes} samples (dimension 0); "
                           "give every input and the target the same number of samples")
    if sizes and sizes[0] < microbatches:
        raise DatasetError(f"minibatch {index} has {sizes[0]} samples, fewer than its "
                           f"{microbatches} microbatches; give it {microbatches} at least, or "
                           "drop it (a DataLoader with drop_last=True drops a short last batch)")


def check_held_out(index: int, batch: Batch, example: Batch) -> None:
    """Held-out batch ``index`` must have the example's inputs, their names, dtypes and
    dimensions (and its target's), at any sizes: the graph traced from the example runs
    it (a DatasetError naming both, before anything is sent)."""
    for what, got, want in (("input", batch[0], example[0]), ("target", batch[1], example[1])):
        _refuse_no_tensors(f"held-out batch {index}'s {what}", got)
        every = range(max((t.dim() for t in (*_tensors(got), *_tensors(want))), default=0))
        if _fixed(got, every) != _fixed(want, every):
            raise DatasetError(
                f"held-out batch {index}'s {what} is {', '.join(_signature(got))} but the "
                f"example's is {', '.join(_signature(want))}; give every batch evaluate() "
                "takes the example's inputs, by the same names, dtypes and dimensions (their "
                "sizes may differ)")


def _samples(batch: Batch) -> int:
    return int(batch[1].shape[0]) if batch[1].dim() else 1


def _per_sample(batch: Batch) -> int:
    """Elements per sample over the input and the target: what a longer sequence adds to."""
    return sum(t.numel() // max(int(t.shape[0]), 1) if t.dim() else 1
               for t in (*_tensors(batch[0]), batch[1]))


class BatchShapes:
    """The minibatches a Pipeline accepts (:meth:`check`) and the largest it met."""

    def __init__(self, example: Batch, variable_dims: Sequence[int], microbatches: int) -> None:
        self.example, self.variable_dims = example, tuple(variable_dims)
        self.microbatches = microbatches
        self._longest, self._per_sample = example, _per_sample(example)
        self._most = _samples(example)

    def check(self, index: int, batch: Batch) -> None:
        """Refuse minibatch ``index`` if it is shaped unlike the example (DatasetError);
        else note its size."""
        check_batch(index, batch, self.example, self.variable_dims, self.microbatches)
        if not self.variable_dims:
            return
        self._most = max(self._most, _samples(batch))
        if _per_sample(batch) > self._per_sample:  # a copy: the caller may reuse its tensors
            self._longest = (map_inputs(batch[0], torch.clone), batch[1].clone())
            self._per_sample = _per_sample(batch)

    def largest(self) -> tuple[Batch, int]:
        """A minibatch of the longest samples met, and the samples of the largest
        microbatch met, which it holds at least (its samples repeated where fewer)."""
        size = math.ceil(self._most / self.microbatches)
        x, y = self._longest
        times = math.ceil(size / _samples(self._longest))
        if times == 1:
            return (x, y), size
        return (map_inputs(x, lambda t: torch.cat([t] * times)), torch.cat([y] * times)), size

"""A stage whose forward writes its input in place: it runs on a copy of it.

A stage after the first receives its input as a leaf of autograd that requires
grad, which an in-place op may not write (``ReLU(inplace=True)`` first thing, as
a cut before a torchvision-style model's in-place ReLU gives); in one process the
same op writes the non-leaf output of the layer before. So a stage's first forward
runs on the input itself, and if autograd refuses that write before anything else
moved (the random state, a buffer), it runs again on a copy, as every forward after
it does: the copy is the non-leaf, and its gradient flows back to the input. A forward
without autograd (a recomputing stage's) writes its input unseen, and the backward runs
it again on that input: its first one runs on a copy, which tells.
docs/design.md §8.4.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import torch
from torch import Tensor, nn

from dreampipe.errors import ConfigError

__all__ = ["InputWrites"]

_T = TypeVar("_T")
_X = TypeVar("_X")
_LEAF_WRITE = "leaf Variable that requires grad is being used in an in-place operation"


class InputWrites:
    """Whether ``module``'s forward (stage ``stage``'s) writes its input in place: unknown
    until its first forward where the input is a leaf that requires grad (``applies``)."""

    def __init__(self, module: nn.Module, stage: int, *, applies: bool) -> None:
        self._module, self._stage = module, stage
        #: None: not known yet; True: every forward runs on a copy of its input.
        self.copies: bool | None = None if applies else False

    def input(self, x: object) -> object:
        """What the forward runs on: ``x``, or a copy of it where the forward writes it."""
        return x.clone() if self.copies and isinstance(x, Tensor) else x

    def run(self, forward: Callable[[], _T], x: object) -> _T:
        """``forward()`` on ``x`` (which it reads through :meth:`input`); the first one again
        on a copy where autograd refused its write of ``x``, one tensor (a pack of several is
        a traced segment's, which copies what it writes itself)."""
        if self.copies is not None or not isinstance(x, Tensor):
            return forward()
        rng, version = torch.get_rng_state(), x._version
        buffers = [b._version for b in self._module.buffers()]
        try:
            out = forward()
        except RuntimeError as exc:
            if _LEAF_WRITE not in str(exc):
                raise
            if x._version != version or not torch.equal(rng, torch.get_rng_state()) or (
                    buffers != [b._version for b in self._module.buffers()]):
                raise ConfigError(
                    f"stage {self._stage}'s forward writes its input in place after it drew "
                    "random numbers or moved a buffer, so it cannot run again on a copy; "
                    "make that op out of place", "plan") from exc
            self.copies = True
            return forward()
        self.copies = False
        return out

    def run_without_grad(self, forward: Callable[[_X], _T], x: _X) -> _T:
        """``forward(x)`` without autograd, which lets it write ``x`` unseen, where the stage
        runs it again in its backward (recomputing, or not stashing) on ``x`` as it was: the
        first one, while unknown, runs on a copy, and whether the copy was written says
        whether every later one must (:meth:`input`)."""
        if self.copies is not None or not isinstance(x, Tensor):
            return forward(x)
        copy = x.detach().clone()
        version = copy._version
        out = forward(cast(_X, copy))
        self.copies = copy._version != version
        return out

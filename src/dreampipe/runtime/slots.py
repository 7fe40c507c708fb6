"""Run a module with other tensors in its parameters' places: a weight version's.

A stage runs each forward on a *version* of its weights (:mod:`.stage`), so
the autograd graph holds that version's tensors. ``torch.func.functional_call``
does that by putting the tensors in the module's parameter slots for the call
and the parameters back after it, but it resolves every name and looks for
tied weights on each call. :class:`ParameterSlots` finds the slots once
(every place a parameter is registered, tied ones included) and then swaps
plain dict entries, as ``functional_call`` itself does: the per-call host
time then grows with the number of parameter tensors only, not with name
look-ups, which matters for small stages and small microbatches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

__all__ = ["ParameterSlots"]


class ParameterSlots:
    """Every registration of ``params`` in ``module`` (a weight tied to two layers has two)."""

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter]) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        self._module = module
        self._slots = [  # each submodule once, each of its entries holding one of params
            (sub, attr, index[id(p)]) for sub in module.modules()
            for attr, p in sub._parameters.items() if p is not None and id(p) in index
        ]

    def call(self, tensors: Sequence[Tensor], args: tuple[Any, ...]) -> Any:
        """``module(*args)`` with ``tensors[i]`` in every place of ``params[i]``; the
        parameters are back in their places afterwards, also when the call raises."""
        slots = self._slots
        originals = [sub._parameters[attr] for sub, attr, _ in slots]
        try:
            for sub, attr, i in slots:
                sub._parameters[attr] = tensors[i]  # type: ignore[assignment]
            return self._module(*args)
        finally:
            for (sub, attr, _), original in zip(slots, originals, strict=True):
                sub._parameters[attr] = original

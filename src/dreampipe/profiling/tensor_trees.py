"""The tensors of a layer's (nested) inputs and outputs, as the profiler walks them.

A step's value is a tensor or a tuple, list or dict of them; the profiler runs each
layer on fresh leaf copies of its inputs (:func:`fresh`), keeps the recorded values cut
from the autograd graph (:func:`detach`) and reads every tensor in a fixed order
(:func:`tensors`), so that a layer's figures do not depend on what ran before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

__all__ = ["detach", "fresh", "storages", "tensors"]


def fresh(value: Any, leaves: list[Tensor]) -> Any:
    """A copy safe to run on: activations become new leaves (cloned, so in-place ops work),
    appended to ``leaves``."""
    if isinstance(value, nn.Parameter):
        return value
    if isinstance(value, Tensor):
        if value.requires_grad:
            leaf = value.detach().clone().requires_grad_(True)
            leaves.append(leaf)
            return leaf.clone()
        return value.clone()
    if isinstance(value, tuple | list):
        return type(value)(fresh(v, leaves) for v in value)
    if isinstance(value, dict):
        return {k: fresh(v, leaves) for k, v in value.items()}
    return value


def detach(value: Any) -> Any:
    """Cut the autograd graph; tensors that carried gradient stay marked ``requires_grad``."""
    if isinstance(value, nn.Parameter):
        return value
    if isinstance(value, Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    if isinstance(value, tuple | list):
        return type(value)(detach(v) for v in value)
    if isinstance(value, dict):
        return {k: detach(v) for k, v in value.items()}
    return value


def tensors(value: Any) -> Iterator[Tensor]:
    """Every tensor in a (nested) tuple/list/dict output, in a fixed order."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v)


def storages(value: Any) -> dict[int, int]:
    """The storages of the tensors in ``value`` by address: their size in bytes (a view
    counts its whole storage, once)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors(value) if t.device.type != "meta"}

"""Profile a model in the number formats it will train in.

A layer's time and the bytes of its activations depend on the dtypes it computes
in: under ``torch.autocast`` its GEMMs run in 16 bits, and with 16-bit parameters
(``precision="bf16"``) so does the rest. :func:`in_formats` runs the profiler's
passes so: the model's floating parameters and buffers in ``param_dtype`` for the
while (given back as they were, not rounded) and the forwards under autocast. With 16-bit
parameters the loss takes the output in fp32, as the last stage does
(:func:`loss_in_fp32`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

__all__ = ["in_formats", "loss_in_fp32"]


@contextmanager
def in_formats(model: nn.Module, sample: Any, device_type: str, *,
               autocast: torch.dtype | None, param_dtype: torch.dtype) -> Iterator[Any]:
    """Within: ``model`` in ``param_dtype`` and forwards under autocast in ``autocast``
    (None: none); yields ``sample`` with its floating tensors in ``param_dtype``."""
    kept: list[tuple[Tensor, Tensor]] = []
    if param_dtype != torch.float32:
        kept = [(t, t.data) for t in (*model.parameters(), *model.buffers())
                if t.is_floating_point()]
        for t, data in kept:
            t.data = data.to(param_dtype)
        sample = pytree.tree_map(
            lambda v: v.to(param_dtype) if isinstance(v, Tensor) and v.is_floating_point()
            else v, sample)
    cast = torch.autocast(device_type, autocast) if autocast is not None else nullcontext()
    try:
        with cast:
            yield sample
    finally:
        for t, data in kept:
            t.data = data


def loss_in_fp32(loss_fn: Callable[..., Tensor], param_dtype: torch.dtype
                 ) -> Callable[..., Tensor]:
    """``loss_fn`` taking the model's output with its floating tensors in fp32 when the
    parameters are 16-bit (``loss_fn`` itself otherwise)."""
    if param_dtype == torch.float32:
        return loss_fn

    def loss(output: Any, *rest: Any) -> Tensor:
        up = pytree.tree_map(lambda v: v.float() if isinstance(v, Tensor)
                             and v.is_floating_point() else v, output)
        return loss_fn(up, *rest)

    return loss

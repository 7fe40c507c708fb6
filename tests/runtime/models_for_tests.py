"""Models the runtime tests start by import path ("runtime.models_for_tests:NAME")."""

from __future__ import annotations

import time

from torch import Tensor, nn

from dreampipe.models import get_model
from dreampipe.models.spec import ModelSpec

__all__ = ["crash_mlp", "stall_mlp", "tuple_mlp"]


class _Stall(nn.Module):
    """Hangs on real data (not on the meta device used by the input checks)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "meta":
            time.sleep(3600)
        return x


class _Crash(nn.Module):
    """Raises on real data (not on the meta device used by the input checks)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "meta":
            raise ValueError("crash layer reached")
        return x


class _Pair(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x


def _with_layer(index: int, name: str, layer: type[nn.Module], **kw: int) -> ModelSpec:
    base = get_model("mlp", **kw)
    factories = list(base.layer_factories)
    factories.insert(index, (name, layer))
    return ModelSpec(
        name=f"mlp+{name}", layer_factories=factories, sample_input=base.sample_input,
        sample_target=base.sample_target, loss_fn=base.loss_fn,
    )


def stall_mlp(**kw: int) -> ModelSpec:
    """An mlp with a layer at index 2 that never returns."""
    return _with_layer(2, "stall", _Stall, **kw)


def crash_mlp(**kw: int) -> ModelSpec:
    """An mlp with a layer at index 2 that raises a ValueError."""
    return _with_layer(2, "crash", _Crash, **kw)


def tuple_mlp(**kw: int) -> ModelSpec:
    """An mlp with a layer at index 2 that returns a pair of tensors."""
    return _with_layer(2, "pair", _Pair, **kw)

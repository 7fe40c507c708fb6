"""Models the runtime tests start by import path ("runtime.models_for_tests:NAME")."""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dreampipe.models import get_model
from dreampipe.models.spec import LayerFactory, ModelSpec

__all__ = [
    "bn_mlp", "crash_mlp", "crash_replica_mlp", "inf_mlp", "ready_mlp", "stall_mlp", "tuple_mlp",
]


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


class _CrashOnRank1(nn.Module):
    """Raises on rank 1's real data only: its replica peers are left in the all-reduce."""

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "meta" and dist.is_initialized() and dist.get_rank() == 1:
            raise ValueError("crash on rank 1")
        return x


class _InfAt(nn.Module):
    """Identity, except that its ``at``-th forward on real data (from 0) returns +inf."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "meta":
            return x
        self.calls += 1
        return x + float("inf") if self.calls - 1 == self.at else x


class _Ready(nn.Module):
    """Identity that, at its first forward on real data, writes ``<folder>/rank<RANK>``
    holding its pid: how a test finds the process running it, to signal it from outside."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.told = False

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "meta" and not self.told and "RANK" in os.environ:
            self.told = True  # a worker's first microbatch (not the profiler's, nor the meta check)
            mark = self.folder / f"rank{os.environ['RANK']}"
            mark.with_suffix(".tmp").write_text(str(os.getpid()))
            mark.with_suffix(".tmp").rename(mark)
        return x


class _Pair(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x


def _with_layer(index: int, name: str, layer: LayerFactory, **kw: int) -> ModelSpec:
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


def crash_replica_mlp(**kw: int) -> ModelSpec:
    """An mlp with a layer at index 2 that raises a ValueError on rank 1 only."""
    return _with_layer(2, "crash", _CrashOnRank1, **kw)


def inf_mlp(at: int, **kw: int) -> ModelSpec:
    """An mlp with a layer at index 2 that outputs inf at its ``at``-th microbatch, finite
    before."""
    return _with_layer(2, "inf", partial(_InfAt, at), **kw)


def ready_mlp(ready: str, **kw: int) -> ModelSpec:
    """An mlp with a layer at index 2 that tells folder ``ready`` its pid (see ``_Ready``)."""
    return _with_layer(2, "ready", partial(_Ready, ready), **kw)


def tuple_mlp(**kw: int) -> ModelSpec:
    """An mlp with a layer at index 2 that returns a pair of tensors."""
    return _with_layer(2, "pair", _Pair, **kw)


def bn_mlp(layers: int = 4, width: int = 16, in_features: int = 12, classes: int = 5) -> ModelSpec:
    """``layers - 1`` blocks Linear -> BatchNorm1d -> ReLU, then a Linear classifier.

    A model with buffers (running statistics) that its forward updates, and a
    forward that depends on the whole (micro)batch, for the equivalence tests.
    """
    if layers < 2:
        raise ValueError(f"bn_mlp layers={layers}: use at least 2")

    def block(fan_in: int) -> nn.Module:
        return nn.Sequential(nn.Linear(fan_in, width), nn.BatchNorm1d(width), nn.ReLU())

    factories: list[tuple[str, LayerFactory]] = [
        (f"block{i}", partial(block, in_features if i == 0 else width)) for i in range(layers - 1)
    ]
    factories.append(("out", partial(nn.Linear, width, classes)))

    def sample_input(batch: int) -> Tensor:
        return torch.randn(batch, in_features)

    def sample_target(batch: int) -> Tensor:
        return torch.randint(0, classes, (batch,))

    return ModelSpec(
        name="bn_mlp", layer_factories=factories, sample_input=sample_input,
        sample_target=sample_target, loss_fn=nn.functional.cross_entropy,
    )

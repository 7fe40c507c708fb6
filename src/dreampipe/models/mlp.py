"""``mlp``: a stack of Linear+ReLU layers, the runtime's benchmark workload."""

from __future__ import annotations

import torch
from torch import nn

from dreampipe.errors import ProfileError
from dreampipe.models.spec import LayerFactory, ModelSpec

__all__ = ["mlp"]


def mlp(
    layers: int = 8, width: int = 1024, in_features: int = 64, classes: int = 10
) -> ModelSpec:
    """``layers`` hidden Linear+ReLU blocks of ``width``, then a classifier.

    The first block maps ``in_features`` to ``width``; the last hidden block
    maps ``width`` to ``classes`` (no ReLU), so there are exactly ``layers``
    profiled layers.
    """
    if layers < 1:
        raise ProfileError(f"mlp layers={layers}: use at least 1")

    def block(i: int) -> LayerFactory:
        fan_in = in_features if i == 0 else width
        if i == layers - 1:
            return lambda: nn.Linear(fan_in, classes)
        return lambda: nn.Sequential(nn.Linear(fan_in, width), nn.ReLU())

    def sample_input(batch: int) -> torch.Tensor:
        return torch.randn(batch, in_features)

    def sample_target(batch: int) -> torch.Tensor:
        return torch.randint(0, classes, (batch,))

    return ModelSpec(
        name="mlp",
        layer_factories=[(f"fc{i}", block(i)) for i in range(layers)],
        sample_input=sample_input,
        sample_target=sample_target,
        loss_fn=nn.functional.cross_entropy,
        default_batch_size=32,
    )

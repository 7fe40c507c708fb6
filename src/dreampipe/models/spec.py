"""ModelSpec: a zoo model as a list of layers that any stage can build alone.

A pipeline stage builds only its own layers, yet every stage must start
from the same weights a single process would have. So a model is described
as a list of layer factories, and layer ``i`` is always built right after
``torch.manual_seed(seed + i)``: building layers 4..7 alone gives the same
weights as building 0..7 and keeping 4..7.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LayerFactory", "ModelSpec", "image_classifier"]

LayerFactory = Callable[[], nn.Module]


@dataclass(frozen=True)
class ModelSpec:
    """A model the profiler, planner and runtime can all use.

    ``sample_input(batch)`` returns an input batch, ``sample_target(batch)``
    matching targets, and ``loss_fn(output, target)`` a scalar loss (mean
    over the batch).
    """

    name: str
    layer_factories: Sequence[tuple[str, LayerFactory]]
    sample_input: Callable[[int], torch.Tensor]
    sample_target: Callable[[int], torch.Tensor]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    default_batch_size: int = 32

    @property
    def num_layers(self) -> int:
        return len(self.layer_factories)

    @property
    def layer_names(self) -> list[str]:
        return [name for name, _ in self.layer_factories]

    def build(self, first: int = 0, last: int | None = None, seed: int = 0) -> nn.Sequential:
        """Layers ``first..last`` (inclusive) as an ``nn.Sequential``, named as in the zoo."""
        last = self.num_layers - 1 if last is None else last
        if not 0 <= first <= last < self.num_layers:
            raise ValueError(
                f"layers {first}..{last} are outside 0..{self.num_layers - 1} of {self.name}"
            )
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        with torch.random.fork_rng(devices=[]):
            for i in range(first, last + 1):
                name, factory = self.layer_factories[i]
                torch.manual_seed(seed + i)
                layers[name] = factory()
        return nn.Sequential(layers)

    def build_only(self, real: Collection[int], seed: int = 0) -> nn.Sequential:
        """The whole model with only the layers ``real`` real (as :meth:`build` makes
        them) and every other layer on the ``meta`` device: what one pipeline rank needs,
        its stages' layers (far apart under interleaving)."""
        unknown = sorted(i for i in real if not 0 <= i < self.num_layers)
        if unknown:
            raise ValueError(
                f"layers {unknown} are outside 0..{self.num_layers - 1} of {self.name}")
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        with torch.random.fork_rng(devices=[]):
            for i, (name, factory) in enumerate(self.layer_factories):
                if i in real:
                    torch.manual_seed(seed + i)
                    layers[name] = factory()
                else:
                    with torch.device("meta"):
                        layers[name] = factory()
        return nn.Sequential(layers)


def image_classifier(
    name: str,
    factories: Sequence[tuple[str, LayerFactory]],
    *,
    channels: int,
    image_size: int,
    classes: int,
    default_batch_size: int,
) -> ModelSpec:
    """A zoo classifier: random ``channels x image_size²`` images, labels, cross-entropy."""

    def sample_input(batch: int) -> torch.Tensor:
        return torch.randn(batch, channels, image_size, image_size)

    def sample_target(batch: int) -> torch.Tensor:
        return torch.randint(0, classes, (batch,))

    return ModelSpec(
        name=name,
        layer_factories=factories,
        sample_input=sample_input,
        sample_target=sample_target,
        loss_fn=nn.functional.cross_entropy,
        default_batch_size=default_batch_size,
    )

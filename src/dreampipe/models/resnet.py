"""``resnet50``: ResNet-50 (He et al.) as a chain of bottleneck blocks.

Each bottleneck block is one layer with its skip connection inside, so the
model is still a straight ``nn.Sequential``::

    stem ─▶ layer1_0 … layer1_2 ─▶ layer2_0 … layer2_3 ─▶ layer3_0 … layer3_5
         ─▶ layer4_0 … layer4_2 ─▶ head            (18 layers)

``stem`` is conv 7x7/2 + BN + ReLU + max-pool, ``head`` is global average
pool + fc. ``width_divisor`` divides every channel count;
``image_size=224, width_divisor=1, classes=1000`` is the paper's model.
"""

from __future__ import annotations

import torch
from torch import nn

from dreampipe.errors import ProfileError
from dreampipe.models.spec import LayerFactory, ModelSpec, image_classifier

__all__ = ["Bottleneck", "resnet50"]

_BLOCKS = (3, 4, 6, 3)
_EXPANSION = 4


class Bottleneck(nn.Module):
    """1x1 → 3x3 (stride) → 1x1 convolutions plus the skip: ``relu(f(x) + skip(x))``."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * _EXPANSION
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        result: torch.Tensor = self.relu(out + self.downsample(x))
        return result


def resnet50(image_size: int = 32, width_divisor: int = 4, classes: int = 10) -> ModelSpec:
    """ResNet-50 on ``image_size``^2 RGB images (at least 32)."""
    if image_size < 32:
        raise ProfileError(f"resnet50 image_size={image_size}: use 32 or more")
    if width_divisor < 1 or 64 % width_divisor:
        raise ProfileError(f"resnet50 width_divisor={width_divisor}: use a divisor of 64, e.g. 4")
    base = 64 // width_divisor
    factories: list[tuple[str, LayerFactory]] = [("stem", lambda: _stem(base))]
    cin = base
    for stage, blocks in enumerate(_BLOCKS):
        width = base * 2**stage
        for b in range(blocks):
            stride = 2 if b == 0 and stage > 0 else 1
            factories.append((f"layer{stage + 1}_{b}", _block(cin, width, stride)))
            cin = width * _EXPANSION
    factories.append(("head", lambda: nn.Sequential(
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))))

    return image_classifier(
        "resnet50", factories, channels=3, image_size=image_size,
        classes=classes, default_batch_size=32,
    )


def _stem(cout: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, cout, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
    )


def _block(cin: int, width: int, stride: int) -> LayerFactory:
    return lambda: Bottleneck(cin, width, stride)

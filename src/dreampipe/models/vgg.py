"""``vgg16``: VGG-16 (Simonyan & Zisserman), scaled down for CPUs by default.

Layers: each 3x3 convolution with its ReLU is one layer, each max-pool is
one layer, then three classifier layers (``fc6``, ``fc7``, ``fc8``): 21 in
all. ``width_divisor`` divides every channel count and the 4096-wide
classifier; ``width_divisor=1, image_size=224, classes=1000`` is the paper's
model.
"""

from __future__ import annotations

from torch import nn

from dreampipe.errors import ProfileError
from dreampipe.models.spec import LayerFactory, ModelSpec, image_classifier

__all__ = ["vgg16"]

_CONFIG: tuple[tuple[int, ...], ...] = (
    (64, 64),
    (128, 128),
    (256, 256, 256),
    (512, 512, 512),
    (512, 512, 512),
)


def vgg16(image_size: int = 32, width_divisor: int = 4, classes: int = 10) -> ModelSpec:
    """VGG-16 on ``image_size``^2 RGB images (a multiple of 32)."""
    if image_size < 32 or image_size % 32:
        raise ProfileError(
            f"vgg16 image_size={image_size}: use a multiple of 32 (five 2x2 poolings), e.g. 32"
        )
    if width_divisor < 1 or 64 % width_divisor:
        raise ProfileError(f"vgg16 width_divisor={width_divisor}: use a divisor of 64, e.g. 4")
    factories: list[tuple[str, LayerFactory]] = []
    cin = 3
    for block, widths in enumerate(_CONFIG, start=1):
        for j, width in enumerate(widths, start=1):
            cout = width // width_divisor
            factories.append((f"conv{block}_{j}", _conv(cin, cout)))
            cin = cout
        factories.append((f"pool{block}", lambda: nn.MaxPool2d(2)))
    flat = cin * (image_size // 32) ** 2
    hidden = 4096 // width_divisor
    factories += [
        ("fc6", lambda: nn.Sequential(
            nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(), nn.Dropout())),
        ("fc7", lambda: nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout())),
        ("fc8", lambda: nn.Linear(hidden, classes)),
    ]

    return image_classifier(
        "vgg16", factories, channels=3, image_size=image_size,
        classes=classes, default_batch_size=32,
    )


def _conv(cin: int, cout: int) -> LayerFactory:
    return lambda: nn.Sequential(nn.Conv2d(cin, cout, kernel_size=3, padding=1), nn.ReLU())

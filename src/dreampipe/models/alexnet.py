"""``alexnet``: AlexNet (Krizhevsky et al.), one layer per conv/pool/fc.

Layers ``conv1 pool1 conv2 pool2 conv3 conv4 conv5 pool3 fc6 fc7 fc8``
(each conv with its ReLU; ``fc6`` and ``fc7`` with dropout and ReLU).
``width_divisor`` divides the channel counts and the 4096-wide classifier;
``image_size=224, width_divisor=1, classes=1000`` is the paper's model.
"""

from __future__ import annotations

from torch import nn

from dreampipe.errors import ProfileError
from dreampipe.models.spec import LayerFactory, ModelSpec, image_classifier

__all__ = ["alexnet"]


def alexnet(image_size: int = 64, width_divisor: int = 4, classes: int = 10) -> ModelSpec:
    """AlexNet on ``image_size``^2 RGB images (at least 63)."""
    side = _feature_side(image_size)
    if side < 1:
        raise ProfileError(f"alexnet image_size={image_size} is too small; use 63 or more")
    if width_divisor < 1 or 64 % width_divisor:
        raise ProfileError(f"alexnet width_divisor={width_divisor}: use a divisor of 64, e.g. 4")
    c1, c2, c3, c4 = (c // width_divisor for c in (64, 192, 384, 256))
    hidden = 4096 // width_divisor
    flat = c4 * side * side

    def pool() -> nn.Module:
        return nn.MaxPool2d(kernel_size=3, stride=2)

    factories: list[tuple[str, LayerFactory]] = [
        ("conv1", _conv(3, c1, kernel=11, stride=4, padding=2)),
        ("pool1", pool),
        ("conv2", _conv(c1, c2, kernel=5, stride=1, padding=2)),
        ("pool2", pool),
        ("conv3", _conv(c2, c3, kernel=3, stride=1, padding=1)),
        ("conv4", _conv(c3, c4, kernel=3, stride=1, padding=1)),
        ("conv5", _conv(c4, c4, kernel=3, stride=1, padding=1)),
        ("pool3", pool),
        ("fc6", lambda: nn.Sequential(
            nn.Flatten(), nn.Dropout(), nn.Linear(flat, hidden), nn.ReLU())),
        ("fc7", lambda: nn.Sequential(nn.Dropout(), nn.Linear(hidden, hidden), nn.ReLU())),
        ("fc8", lambda: nn.Linear(hidden, classes)),
    ]

    return image_classifier(
        "alexnet", factories, channels=3, image_size=image_size,
        classes=classes, default_batch_size=32,
    )


def _conv(cin: int, cout: int, *, kernel: int, stride: int, padding: int) -> LayerFactory:
    return lambda: nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, padding), nn.ReLU())


def _feature_side(image_size: int) -> int:
    """Side of the last feature map: conv1 (11, stride 4, pad 2) then three 3/2 pools."""
    side = (image_size + 4 - 11) // 4 + 1
    for _ in range(3):
        side = (side - 3) // 2 + 1
    return side

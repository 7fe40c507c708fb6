"""``cnn``: the classic MNIST pipeline example, five layers.

::

    1xSxS ─conv1─▶ 16xS/2xS/2 ─conv2─▶ 32xS/4xS/4 ─fc1─▶ 200 ─fc2─▶ 200 ─out─▶ 10

Each conv layer is Conv(5x5, same padding) + ReLU + MaxPool(2), so at the
default ``image_size=28`` the feature maps are 16@14x14 and 32@7x7. The
scikit-learn 8x8 digits work either as ``image_size=8`` (maps 4x4 and 2x2)
or resized to 28x28; any size divisible by 4 does.
"""

from __future__ import annotations

from torch import nn

from dreampipe.errors import ProfileError
from dreampipe.models.spec import LayerFactory, ModelSpec, image_classifier

__all__ = ["cnn"]


def cnn(image_size: int = 28, channels: int = 1, classes: int = 10, hidden: int = 200) -> ModelSpec:
    """Conv 1→16, Conv 16→32, Dense ``hidden``, Dense ``hidden``, Output ``classes``."""
    if image_size < 4 or image_size % 4:
        raise ProfileError(
            f"cnn image_size={image_size}: use a multiple of 4 (two 2x2 poolings), e.g. 8 or 28"
        )
    flat = 32 * (image_size // 4) ** 2

    def conv(cin: int, cout: int) -> LayerFactory:
        return lambda: nn.Sequential(
            nn.Conv2d(cin, cout, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2)
        )

    factories: list[tuple[str, LayerFactory]] = [
        ("conv1", conv(channels, 16)),
        ("conv2", conv(16, 32)),
        ("fc1", lambda: nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU())),
        ("fc2", lambda: nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())),
        ("out", lambda: nn.Linear(hidden, classes)),
    ]

    return image_classifier(
        "cnn", factories, channels=channels, image_size=image_size,
        classes=classes, default_batch_size=64,
    )

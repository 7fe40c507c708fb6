"""The model zoo: built-in models, no downloads.

``get_model("vgg16")`` returns a :class:`ModelSpec`; keyword arguments size
the model (``get_model("mlp", layers=8, width=1024)``). Every model is a
chain of layers, each taking one tensor and returning one tensor, so any run
of consecutive layers is a pipeline stage. Defaults are small enough to
profile in seconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dreampipe.errors import ProfileError
from dreampipe.models.alexnet import alexnet
from dreampipe.models.cnn import cnn
from dreampipe.models.gnmt import gnmt
from dreampipe.models.mlp import mlp
from dreampipe.models.resnet import resnet50
from dreampipe.models.spec import ModelSpec
from dreampipe.models.transformer import transformer
from dreampipe.models.vgg import vgg16

__all__ = ["ZOO", "ModelSpec", "get_model"]

ZOO: dict[str, Callable[..., ModelSpec]] = {
    "mlp": mlp,
    "cnn": cnn,
    "vgg16": vgg16,
    "alexnet": alexnet,
    "resnet50": resnet50,
    "gnmt": gnmt,
    "transformer": transformer,
}


def get_model(name: str, **kwargs: Any) -> ModelSpec:
    """The zoo model ``name`` sized by ``kwargs``; an unknown name raises :class:`ProfileError`."""
    if name not in ZOO:
        raise ProfileError(f"unknown model {name!r}; the zoo has {', '.join(sorted(ZOO))}")
    return ZOO[name](**kwargs)

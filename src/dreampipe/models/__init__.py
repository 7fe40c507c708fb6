"""The model zoo: built-in models, no downloads.

``get_model("vgg16")`` returns a :class:`ModelSpec`; keyword arguments size
the model (``get_model("mlp", layers=8, width=1024)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dreampipe.models.mlp import mlp
from dreampipe.models.spec import ModelSpec

__all__ = ["ZOO", "ModelSpec", "get_model"]

ZOO: dict[str, Callable[..., ModelSpec]] = {
    "mlp": mlp,
}


def get_model(name: str, **kwargs: Any) -> ModelSpec:
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; the zoo has {', '.join(sorted(ZOO))}")
    return ZOO[name](**kwargs)

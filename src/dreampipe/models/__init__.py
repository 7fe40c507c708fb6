"""The model zoo: built-in models, no downloads.

``get_model("vgg16")`` returns a :class:`ModelSpec`; keyword arguments size
the model (``get_model("mlp", layers=8, width=1024)``). Every model is a
chain of layers, each taking one tensor and returning one tensor, so any run
of consecutive layers is a pipeline stage. Defaults are small enough to
profile in seconds on a CPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dreampipe.errors import ProfileError

if TYPE_CHECKING:
    from dreampipe.models.spec import ModelSpec

__all__ = ["ZOO", "ModelSpec", "get_model", "zoo_function"]


def _lazy(module: str, function: str) -> Callable[..., ModelSpec]:
    """The zoo constructor ``module.function``, imported (with torch) on first call."""

    def build(**kwargs: Any) -> ModelSpec:
        constructor: Callable[..., ModelSpec] = getattr(
            importlib.import_module(f"dreampipe.models.{module}"), function
        )
        return constructor(**kwargs)

    build.__name__ = build.__qualname__ = function
    return build


#: Each zoo model's module and constructor.
_TARGETS = {
    "mlp": ("mlp", "mlp"),
    "cnn": ("cnn", "cnn"),
    "vgg16": ("vgg", "vgg16"),
    "alexnet": ("alexnet", "alexnet"),
    "resnet50": ("resnet", "resnet50"),
    "gnmt": ("gnmt", "gnmt"),
    "transformer": ("transformer", "transformer"),
}
ZOO: dict[str, Callable[..., ModelSpec]] = {
    name: _lazy(*target) for name, target in _TARGETS.items()}


def zoo_function(name: str) -> Callable[..., ModelSpec]:
    """Zoo model ``name``'s own constructor (imported, with torch), whose signature says
    what its keyword arguments are."""
    module, function = _TARGETS[name]
    found: Callable[..., ModelSpec] = getattr(
        importlib.import_module(f"dreampipe.models.{module}"), function)
    return found


def get_model(name: str, **kwargs: Any) -> ModelSpec:
    """The zoo model ``name`` sized by ``kwargs``; an unknown name raises :class:`ProfileError`."""
    if name not in ZOO:
        raise ProfileError(f"unknown model {name!r}; the zoo has {', '.join(sorted(ZOO))}")
    return ZOO[name](**kwargs)


def __getattr__(name: str) -> Any:
    """``ModelSpec`` needs torch: import it on first use, so the zoo's names load fast."""
    if name == "ModelSpec":
        from dreampipe.models.spec import ModelSpec

        return ModelSpec
    raise AttributeError(f"module 'dreampipe.models' has no attribute {name!r}")

"""A model's modules and tensors registered on another module under their FQNs.

A stage holds what its layers read under the names the model gives them, so
its parameter names and state-dict keys are the model's own. A name the
holder already uses for itself (a model's ``self.graph`` on a segment, whose
own field it is too) goes into the holder's registries all the same, where
PyTorch's state dict and :func:`fetch` look first. docs/design.md §2.1.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["fetch", "place", "place_attr"]


def place(target: str, holder: nn.Module, value: Any, *, buffer: bool | None = None) -> None:
    """Register ``value`` at FQN ``target`` of ``holder`` (empty parent modules made as
    needed): a module, a parameter, a buffer (``buffer``: persistent or not) or a tensor.
    A name the holder already uses for itself (a model's ``self.graph`` on a segment)
    goes into its registries all the same, where :func:`fetch` and PyTorch's state dict
    look first."""
    parent = holder
    *path, leaf = target.split(".")
    for part in path:
        child = parent._modules.get(part)
        if child is None:
            child = nn.Module()
            _register(parent, part, child, parent._modules)
        parent = child
    if isinstance(value, nn.Module):
        _register(parent, leaf, value, parent._modules)
    elif isinstance(value, nn.Parameter):
        _register(parent, leaf, value, parent._parameters)
    elif buffer is not None:
        _register(parent, leaf, value, parent._buffers)
        if not buffer:
            parent._non_persistent_buffers_set.add(leaf)
    elif hasattr(parent, leaf) and not any(leaf in r for r in _registries(parent)):
        parent.__dict__.setdefault(_VALUES, {})[leaf] = value  # not over the holder's own
    else:
        setattr(parent, leaf, value)


#: Where :func:`place` keeps a plain value (a tensor the model holds unregistered) whose
#: name the holder already uses for itself.
_VALUES = "_placed_values"


def _register(parent: nn.Module, name: str, value: Any, registry: dict[str, Any]) -> None:
    """``value`` into ``parent``'s ``registry`` (its modules, parameters or buffers) under
    ``name``, past PyTorch's refusal of a name the module's class or instance already has."""
    if name in registry or not hasattr(parent, name):
        if registry is parent._modules:
            parent.add_module(name, value)
        elif registry is parent._parameters:
            parent.register_parameter(name, value)
        else:
            parent.register_buffer(name, value)
    else:
        registry[name] = value


def fetch(root: nn.Module, target: str) -> Any:
    """Attribute ``target`` (an FQN) of ``root``: a module's registered module, parameter or
    buffer first (:func:`place`), else its attribute."""
    value: Any = root
    for part in target.split("."):
        found = next((r[part] for r in (_registries(value)) if part in r), _MISSING)
        value = getattr(value, part) if found is _MISSING else found
    return value


_MISSING = object()


def _registries(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, nn.Module):
        return ()
    return value._modules, value._parameters, value._buffers, value.__dict__.get(_VALUES, {})


def place_attr(root: nn.Module, target: str, holder: nn.Module, value: Any) -> None:
    """Register attribute ``target`` of ``root`` on ``holder`` as what it is there."""
    *path, leaf = target.split(".")
    parent = fetch(root, ".".join(path)) if path else root
    persistent = leaf not in parent._non_persistent_buffers_set
    place(target, holder, value, buffer=persistent if leaf in parent._buffers else None)

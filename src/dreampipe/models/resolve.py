"""One resolver for every command's MODEL argument.

Three forms are accepted everywhere:

- a zoo name (``mlp``), built by :func:`dreampipe.models.get_model`;
- ``package.module:function`` (importable, e.g. from ``PYTHONPATH``);
- ``path/to/file.py:function``.

A function is called with the model arguments (and ``batch_size=N`` when a
batch size is asked for and it takes one) and returns a
:class:`~dreampipe.models.spec.ModelSpec`, or a sample
``(model, sample_input, loss_fn[, target])``: with a target the loss is
``loss_fn(output, target)``, without one ``loss_fn(output)``. A sample can be
profiled but not trained (a stage must build its layers alone), so
:func:`resolve_spec` refuses one in a single line. A model argument whose
parameter is annotated ``int``, ``float``, ``bool`` or ``str`` must be of that
type (``width=1e9`` for an ``int`` is refused, naming it); running out of
memory building a model is one line too (:func:`memory_error`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from dreampipe.errors import ConfigError
from dreampipe.models import ZOO, get_model, zoo_function
from dreampipe.models.spec import ModelSpec
from dreampipe.quantities import format_bytes

__all__ = ["ModelSample", "memory_error", "resolve", "resolve_spec"]

_T = TypeVar("_T")
_RETURNS = "a ModelSpec or (model, sample_input, loss_fn) or (model, sample_input, loss_fn, target)"


@dataclass(frozen=True)
class ModelSample:
    """A whole model with one sample batch: what ``file.py:function`` usually returns."""

    name: str
    module: nn.Module
    sample_input: Tensor
    loss_fn: Callable[..., Tensor]
    target: Tensor | None = None


def resolve(
    ref: str, model_kwargs: Sequence[tuple[str, Any]] = (), *, batch_size: int | None = None
) -> ModelSpec | ModelSample:
    """The model ``ref`` names, sized by ``model_kwargs``; a bad reference is a ConfigError.

    ``batch_size`` goes to a function that takes it; a ModelSpec is measured
    at it later, so only a sample from a function without it is refused.
    """
    kwargs = dict(model_kwargs)
    if ":" not in ref:
        if ref not in ZOO:
            raise ConfigError(
                f"unknown model {ref!r}: use a zoo model ({', '.join(sorted(ZOO))}), "
                "package.module:function or path/to/file.py:function"
            )
        _check_types(ref, zoo_function(ref), kwargs)
        return _checked(ref, kwargs, lambda: get_model(ref, **kwargs))
    func = _function(ref)
    _check_types(ref, func, kwargs)
    passes_batch = batch_size is not None and _takes_batch_size(func)
    if passes_batch:
        kwargs["batch_size"] = batch_size
    result = _checked(ref, kwargs, lambda: func(**kwargs))
    if isinstance(result, ModelSpec):
        return result
    sample = _sample(ref, result)
    if batch_size is not None and not passes_batch:
        raise ConfigError(
            f"{ref} takes no batch_size argument but batch_size={batch_size} was given; "
            f"add a batch_size parameter or drop batch_size={batch_size}", "batch_size",
        )
    return sample


def resolve_spec(ref: str, model_kwargs: Sequence[tuple[str, Any]] = ()) -> ModelSpec:
    """The :class:`ModelSpec` ``ref`` names, for a command that builds stages from it."""
    found = resolve(ref, model_kwargs)
    if isinstance(found, ModelSample):
        raise ConfigError(
            f"model {ref!r} returned (model, sample_input, loss_fn...), which can be profiled "
            "but not trained: a stage builds its own layers; return a ModelSpec instead"
        )
    return found


def _checked(ref: str, kwargs: dict[str, Any], build: Callable[[], _T]) -> _T:
    """``build()``, and a ModelSpec's layers built on the meta device, so bad sizes fail here."""
    try:
        result = build()
        if isinstance(result, ModelSpec):
            with torch.device("meta"):
                result.build(seed=0)
    except (TypeError, ValueError, RuntimeError, MemoryError) as exc:
        if isinstance(exc, ConfigError):
            raise
        short = memory_error(ref, kwargs, exc)
        if short is not None:
            raise short from None
        raise ConfigError(
            f"model {ref!r} with {kwargs}: {exc}; give model arguments the function "
            f"{ref.rpartition(':')[2]}() accepts"
        ) from None
    return result


def _function(ref: str) -> Callable[..., Any]:
    """The function named by ``package.module:function`` or ``file.py:function``."""
    where, _, name = ref.rpartition(":")
    module = where.endswith(".py") or all(part.isidentifier() for part in where.split("."))
    if not (module and name.isidentifier()):
        raise ConfigError(
            f"model {ref!r} is not a zoo name, 'package.module:function' or "
            "'path/to/file.py:function'; give one of those, e.g. mypkg.models:build"
        )
    if where.endswith(".py"):
        func: object = getattr(_load_file(where), name, None)
        if not callable(func):
            raise ConfigError(f"{where} has no function {name!r}; define one returning {_RETURNS}")
        return func
    try:
        found: Callable[..., Any] = getattr(importlib.import_module(where), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"model {ref!r}: cannot import {name!r} from {where!r} ({exc}); give a zoo name, "
            "'package.module:function' or 'path/to/file.py:function'"
        ) from exc
    return found


def _load_file(path_text: str) -> Any:
    path = Path(path_text)
    if not path.is_file():
        raise ConfigError(f"model file {path_text!r} does not exist; give path/to/file.py:function")
    spec = importlib.util.spec_from_file_location(f"_dreampipe_user_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {path_text!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise ConfigError(
            f"cannot import {path_text!r}: SyntaxError at line {exc.lineno}: {exc.msg}; "
            "fix the file"
        ) from exc
    return module


def _sample(ref: str, result: object) -> ModelSample:
    """``result`` checked as ``(model, sample_input, loss_fn[, target])``."""
    if not isinstance(result, tuple) or len(result) not in (3, 4):
        raise ConfigError(f"{ref} returned {type(result).__name__}; it must return {_RETURNS}")
    model, sample, loss_fn = result[:3]
    target = result[3] if len(result) == 4 else None
    if not isinstance(model, nn.Module) or not isinstance(sample, Tensor) or not callable(loss_fn):
        raise ConfigError(
            f"{ref} returned ({type(model).__name__}, {type(sample).__name__}, "
            f"{type(loss_fn).__name__}, ...); expected (nn.Module, Tensor, callable, ...)"
        )
    if target is not None and not isinstance(target, Tensor):
        raise ConfigError(f"{ref} returned a {type(target).__name__} target; expected a Tensor")
    return ModelSample(ref.rpartition(":")[2], model, sample, loss_fn, target)


def _takes_batch_size(func: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return True  # no signature to check: let the call decide
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == "batch_size" and p.kind is not p.POSITIONAL_ONLY)
        for p in params
    )


def memory_error(ref: str, model_kwargs: Mapping[str, Any] | Sequence[tuple[str, Any]],
                 exc: BaseException) -> ConfigError | None:
    """A one-line error for ``exc`` if it says memory ran out building or running ``ref``
    (torch's allocators raise a RuntimeError, Python a MemoryError); None if not."""
    text = str(exc)
    if not (isinstance(exc, MemoryError) or any(m in text for m in _OUT_OF_MEMORY)):
        return None
    asked = re.search(r"tried to allocate (\d+) bytes", text)
    need = f" (it asked for {format_bytes(int(asked.group(1)))} at once)" if asked else ""
    args = " ".join(f"{k}={v}" for k, v in dict(model_kwargs).items()) or "its defaults"
    return ConfigError(
        f"model {ref!r} with {args} ran out of memory{need}; give it smaller model "
        "arguments (--model-arg), or profile a GPT by shape (gpt:...) without building it"
    )


#: What torch and Python say when an allocation fails.
_OUT_OF_MEMORY = ("not enough memory", "DefaultCPUAllocator", "out of memory",
                  "can't allocate memory")


def _check_types(ref: str, func: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Each model argument of the type ``func``'s signature gives it (a whole number where
    it says ``int``), else a one-line error; a number for a ``str`` becomes its text."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return  # no signature to check: the call decides
    for key, value in kwargs.items():
        param = params.get(key)
        wanted = _plain_types(param.annotation) if param is not None else None
        if not wanted or value is None or _fits(value, wanted):
            continue
        if str in wanted and isinstance(value, (int, float)):
            kwargs[key] = str(value)
            continue
        example = param.default if param is not None else None
        if isinstance(value, float) and value.is_integer():
            example = int(value)
        elif isinstance(example, bool) or example is None or not _fits(example, wanted):
            example = _EXAMPLES[wanted[0]]
        raise ConfigError(
            f"model {ref!r}: {key}={value!r} is {_kind(value)}, but {ref.rpartition(':')[2]}() "
            f"takes {' or '.join(_WORDS[t] for t in wanted)} for {key}; give e.g. {key}={example}"
        )


def _plain_types(annotation: object) -> tuple[type, ...] | None:
    """``int``, ``float``, ``bool`` or ``str`` of an annotation that is one or a union of them
    (and None), as types or as text (``"int | None"``, under ``from __future__ import
    annotations``); None for any other annotation, which is not checked."""
    members: tuple[object, ...]
    if isinstance(annotation, str):
        members = tuple(_NAMED.get(part.strip(), part) for part in annotation.split("|"))
    elif isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = typing.get_args(annotation)
    else:
        members = (annotation,)
    plain = tuple(t for t in members if isinstance(t, type) and t in _WORDS)
    if not plain or any(t not in _WORDS and t is not type(None) for t in members):
        return None
    return plain


def _fits(value: object, wanted: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in wanted
    if isinstance(value, int):
        return int in wanted or float in wanted or (bool in wanted and value in (0, 1))
    return isinstance(value, wanted)


def _kind(value: object) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, float):
        return "a float" if math.isfinite(value) else "not a finite number"
    return type(value).__name__


_WORDS: dict[type, str] = {int: "a whole number (int)", float: "a number (float)",
                           bool: "true or false (bool: write 1 or 0)", str: "text (str)"}
_EXAMPLES: dict[type, object] = {int: 4, float: 0.5, bool: 1, str: "relu"}
_NAMED: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str,
                           "None": type(None)}

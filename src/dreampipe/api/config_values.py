"""The checks of single :class:`~dreampipe.api.config.TrainConfig` values: a name among
choices, a number's type, dimension indices, and what an ``autocast=`` dtype means.

Each returns the value as JSON keeps it, or raises a ConfigError naming the field, the
value and the fix (docs/design.md §2.1).
"""

from __future__ import annotations

import difflib

from dreampipe.errors import ConfigError
from dreampipe.runplan.schedule_choice import Semantics
from dreampipe.runtime.nonfinite import OnNonFinite
from dreampipe.runtime.precision import Precision
from dreampipe.scheduling.actions import ScheduleKind

__all__ = ["check_type", "dimension_indices", "named_choice", "precision_of_autocast"]


def named_choice(name: str, value: object, names: tuple[str, ...]) -> str:
    """``value`` (a name, or an enum member with one) as its name, if it is one of ``names``."""
    text = value.value if isinstance(value, ScheduleKind | Semantics | OnNonFinite | Precision) \
        else value
    if isinstance(text, str) and text in names:
        return text
    near = difflib.get_close_matches(str(text), names, n=1)
    hint = f" (nearest: {near[0]})" if near else ""
    raise ConfigError(f"{name}={value!r}; use one of {', '.join(names)}{hint}", name)


def dimension_indices(value: object) -> tuple[int, ...]:
    """``variable_dims`` as a sorted tuple (JSON and TOML give a list), each a dimension's
    index, at most once."""
    items = list(value) if isinstance(value, list | tuple) else None
    if items is None or any(type(d) is not int or d < 0 for d in items) or len(
            set(items)) < len(items):
        raise ConfigError(f"variable_dims={value!r}; give the dimensions that may change from "
                          "step to step, each once, as indices from 0, e.g. variable_dims=(1,) "
                          "for the sequence of [batch, sequence] tokens", "variable_dims")
    return tuple(sorted(items))


def precision_of_autocast(autocast: object) -> str:
    """The precision that says what ``autocast=`` (a dtype or its name) said."""
    name = str(autocast).removeprefix("torch.")
    return {"bfloat16": Precision.BF16_MIXED.value,
            "float16": Precision.FP16_MIXED.value}.get(name, Precision.FP32.value)


def check_type(name: str, value: object, types: tuple[type, ...], what: str,
           optional: bool = False) -> None:
    """``value`` is one of ``types`` (a bool is no number here), or None if ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, types) and (bool in types or not isinstance(value, bool)):
        return
    raise ConfigError(f"{name}={value!r}: {name} takes {what}"
                      f"{' or None' if optional else ''}", name)

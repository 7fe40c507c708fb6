"""Read a plan file's JSON field by field, so a wrong type is an error, not a guess.

:meth:`~dreampipe.planning.plan.Plan.from_dict` reads through :class:`PlanFields`:
a whole number must be one (not ``"2"``, ``true`` or ``10.5``), a flag must be
``true`` or ``false``, a list a list. Each :class:`PlanError` names the field
(``stages[2].replicas``), the value found and what to write instead.
:func:`check_agrees` then holds the plan's ``config`` and ``layer_names`` to its stages.
"""

from __future__ import annotations

import json
import math
from enum import Enum
from typing import Any, TypeVar

from dreampipe.errors import PlanError
from dreampipe.planning.plan_stage import Stage
from dreampipe.planning.splits import Split

__all__ = ["PlanFields", "check_agrees", "read_stages"]

_E = TypeVar("_E", bound=Enum)
#: Marks a field with no default: a plan file must have it.
_REQUIRED: Any = object()
_REWRITE = "(or write the plan again with 'dreampipe plan -o')"


class PlanFields:
    """One JSON object of a plan file (``where`` names it: ``""`` the plan, ``stages[2]``)."""

    def __init__(self, data: object, where: str = "") -> None:
        if not isinstance(data, dict):
            raise _wrong(where or "the plan", data, "an object {...}")
        self.data: dict[str, Any] = data
        self.where = where

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _REQUIRED:
            raise PlanError(f"field {self._name(key)} is missing; add it {_REWRITE}")
        return default

    def whole(self, key: str, default: Any = _REQUIRED) -> int:
        """A whole number (an integral ``2.0`` is taken as ``2``)."""
        return _whole(self._get(key, default), self._name(key))

    def maybe_whole(self, key: str) -> int | None:
        """A whole number, or None where the field is missing or null."""
        value = self._get(key, None)
        return None if value is None else _whole(value, self._name(key))

    def number(self, key: str, default: Any = _REQUIRED) -> float:
        value = self._get(key, default)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _wrong(self._name(key), value, "a number, e.g. 0.5")

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if isinstance(value, bool):
            return value
        raise _wrong(self._name(key), value, "true or false")

    def text(self, key: str, default: Any = _REQUIRED) -> str:
        value = self._get(key, default)
        if isinstance(value, str):
            return value
        raise _wrong(self._name(key), value, 'text in quotes, e.g. ""')

    def items(self, key: str, default: Any = _REQUIRED) -> list[Any]:
        value = self._get(key, default)
        if isinstance(value, list):
            return value
        raise _wrong(self._name(key), value, "a list [...]")

    def wholes(self, key: str, default: Any = _REQUIRED) -> tuple[int, ...]:
        return tuple(_whole(x, f"{self._name(key)}[{i}]")
                     for i, x in enumerate(self.items(key, default)))

    def texts(self, key: str, default: Any = _REQUIRED) -> tuple[str, ...]:
        found = self.items(key, default)
        for i, x in enumerate(found):
            if not isinstance(x, str):
                raise _wrong(f"{self._name(key)}[{i}]", x, 'text in quotes, e.g. "fc1"')
        return tuple(found)

    def numbers_by_name(self, key: str) -> dict[str, float]:
        inner = PlanFields(self._get(key, _REQUIRED), self._name(key))
        return {name: inner.number(name) for name in inner.data}

    def objects(self, key: str) -> list[PlanFields]:
        return [PlanFields(x, f"{self._name(key)}[{i}]")
                for i, x in enumerate(self.items(key))]

    def choice(self, key: str, kind: type[_E], default: _E) -> _E:
        value = self._get(key, default)
        return value if isinstance(value, kind) else _member(kind, value, self._name(key))

    def choices(self, key: str, kind: type[_E]) -> tuple[_E, ...]:
        return tuple(_member(kind, x, f"{self._name(key)}[{i}]")
                     for i, x in enumerate(self.items(key, [])))


def read_stages(plan: PlanFields) -> tuple[Stage, ...]:
    """The ``stages`` of a plan file, each field checked for its type."""
    return tuple(
        Stage(
            first=s.whole("first"), last=s.whole("last"), replicas=s.whole("replicas"),
            ranks=s.wholes("ranks"), compute_s=s.number("compute_s"),
            comm_s=s.number("comm_s"), allreduce_s=s.number("allreduce_s"),
            allreduce_delay_s=s.number("allreduce_delay_s", 0.0),
            memory_bytes=s.whole("memory_bytes"), forward_s=s.number("forward_s", 0.0),
            workers=s.wholes("workers", []), tensor_parallel=s.whole("tensor_parallel", 1),
            splits=s.choices("splits", Split), in_flight=s.whole("in_flight", 0),
            recompute=s.flag("recompute", False), zero=s.maybe_whole("zero"),
            shared_link_s=s.number("shared_link_s", 0.0), loop_s=s.number("loop_s", 0.0),
        )
        for s in plan.objects("stages")
    )


def check_agrees(fields: PlanFields, *, config: str, names: int, num_layers: int,
                 batch_size: int) -> None:
    """The file's ``config`` and layer names (``names`` of them) say what its stages say
    (``config``, ``num_layers``); its ``batch_size`` is not negative."""
    written = fields.text("config", config)
    if written != config:
        raise PlanError(f"config={written!r} does not match the stages, which make "
                        f"{config!r}; fix config or the stages {_REWRITE}")
    if names and names != num_layers:
        raise PlanError(f"layer_names holds {names} name{'s' * (names != 1)} but num_layers="
                        f"{num_layers}; give one name per layer or none {_REWRITE}")
    if batch_size < 0:
        raise PlanError(f"batch_size={batch_size}; give the minibatch size the plan was "
                        f"made for, or 0 for unknown {_REWRITE}")


def _whole(value: object, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        raise _wrong(name, value, f"a whole number without quotes, e.g. {int(value)}")
    raise _wrong(name, value, "a whole number")


def _member(kind: type[_E], value: object, name: str) -> _E:
    try:
        return kind(value)
    except (ValueError, TypeError):
        known = ", ".join(json.dumps(m.value) for m in kind)
        raise PlanError(f"{name}={_shown(value)} is not one of {known}; write one of them "
                        f"{_REWRITE}") from None


def _wrong(name: str, value: object, expected: str) -> PlanError:
    found = f"{name} is null" if value is None else f"{name}={_shown(value)} is {_kind(value)}"
    return PlanError(f"{found}; write {expected} {_REWRITE}")


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a true/false flag"
    if isinstance(value, str):
        return "text"
    if isinstance(value, float):
        return "a fraction" if math.isfinite(value) else "not a finite number"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "a number" if isinstance(value, int) else type(value).__name__


def _shown(value: object) -> str:
    """``value`` as JSON writes it (``null``, ``"2"``), cut to one short line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

"""Read PipeDream's ``graph.txt`` profiles into a :class:`LayerGraph`.

Format (PipeDream's profiler output, docs/design.md §2)::

    node4 -- Conv2d(3, 64, ...) -- forward_compute_time=1.2, backward_compute_time=2.5, \
activation_size=1024.0, parameter_size=7168.000
    \tnode4 -- node5

Times are milliseconds and sizes bytes for the whole minibatch; an
``activation_size`` may be a list ``[a; b; c]`` (a layer with several
outputs), which is summed. Layers are sorted topologically, ties broken by
node number, so the order is deterministic.
"""

from __future__ import annotations

import math
import re

from dreampipe.errors import ProfileError
from dreampipe.profiling.graph import Layer, LayerGraph

__all__ = ["parse_graph_txt"]

_NODE = re.compile(r"^(node\d+) -- (.*) -- (forward_compute_time=.*)$")
_EDGE = re.compile(r"^\s+(node\d+) -- (node\d+)\s*$")
_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


def parse_graph_txt(text: str, model: str = "") -> LayerGraph:
    """Parse a PipeDream graph.txt; a malformed line raises naming its number."""
    layers: list[Layer] = []
    edges: list[tuple[str, str]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if m := _EDGE.match(line):
            edges.append((m.group(1), m.group(2)))
        elif m := _NODE.match(line):
            layers.append(_parse_node(m.group(1), m.group(2), m.group(3), lineno))
        else:
            raise ProfileError(
                f"graph.txt line {lineno} is neither a node nor an edge: {line[:80]!r}; "
                "expected 'nodeN -- desc -- forward_compute_time=...' or '\\tnodeX -- nodeY'"
            )
    if not layers:
        raise ProfileError("graph.txt has no node lines; is it a PipeDream profile?")
    layers.sort(key=lambda x: int(x.name[4:]))
    return LayerGraph.from_named_edges(layers, edges, batch_size=0, model=model)


def _parse_node(name: str, description: str, stats: str, lineno: int) -> Layer:
    values: dict[str, float] = {}
    for part in _split_stats(stats):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in _FIELDS:
            raise ProfileError(f"graph.txt line {lineno}: unexpected field {part.strip()!r}")
        values[key] = _number(raw.strip(), key, lineno, name)
    missing = [f for f in _FIELDS if f not in values]
    if missing:
        raise ProfileError(f"graph.txt line {lineno}: {name} lacks {', '.join(missing)}")
    try:
        return Layer(
            name=name,
            forward_ms=values["forward_compute_time"],
            backward_ms=values["backward_compute_time"],
            activation_bytes=round(values["activation_size"]),
            parameter_bytes=round(values["parameter_size"]),
            description=description.strip(),
        )
    except ProfileError as exc:
        raise ProfileError(f"graph.txt line {lineno}: {exc}") from exc


def _split_stats(stats: str) -> list[str]:
    """Split on commas outside ``[...]`` lists."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(stats):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(stats[start:i])
            start = i + 1
    parts.append(stats[start:])
    return [p for p in parts if p.strip()]


def _number(raw: str, key: str, lineno: int, name: str) -> float:
    """A field's value, a ``[a; b]`` list summed; it must be finite."""
    items = raw[1:-1].split(";") if raw.startswith("[") and raw.endswith("]") else [raw]
    try:
        value = sum(float(x) for x in items)
    except ValueError:
        raise ProfileError(
            f"graph.txt line {lineno}: {name} has {key}={raw!r}, which is not a number"
        ) from None
    if not math.isfinite(value):
        raise ProfileError(
            f"graph.txt line {lineno}: {name} has {key}={raw!r}, which is not finite; "
            "times and sizes must be finite non-negative numbers"
        )
    return value

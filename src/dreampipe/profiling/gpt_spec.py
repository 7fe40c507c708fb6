"""``gpt:layers=L,hidden=H,heads=A,seq=S,vocab=V``: a GPT-style profile named by its shape.

Wherever a profile is taken, this text stands for the profile
:func:`~dreampipe.profiling.gpt_shapes.gpt_profile` builds from the shape,
timed on a :class:`~dreampipe.profiling.devices.Device` (the cluster preset's),
so that a model too large to profile here can be planned at scale. Optional
keys: ``batch`` (sequences per minibatch, default 1) and ``param_bytes``
(bytes per weight and per gradient: 4, the default, or 2). Parsing is strict:
an unknown, missing or repeated key, a value that is not a whole number >= 1,
or heads that do not divide the width is an error naming the value and the
fix (docs/planner.md, "Profiles by shape").
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from dreampipe.errors import ProfileError
from dreampipe.profiling.devices import Device
from dreampipe.profiling.gpt_shapes import GptShape, gpt_profile
from dreampipe.profiling.graph import LayerGraph

__all__ = ["BY_SHAPE", "EXAMPLE", "OPTIONAL", "SCHEME", "GptSpec", "by_shape", "gpt_spec_profile",
           "is_gpt_spec", "parse_gpt_spec"]

SCHEME = "gpt:"
#: The keys a spec must give, in the order its text writes them.
_REQUIRED = ("layers", "hidden", "heads", "seq", "vocab")
#: Optional keys and their defaults.
OPTIONAL = {"batch": 1, "param_bytes": 4}
_PARAM_BYTES = (2, 4)
EXAMPLE = "gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=50257"
#: ``LayerGraph.meta`` key of a profile by shape: its spec's text.
BY_SHAPE = "by_shape"


@dataclass(frozen=True)
class GptSpec:
    """A parsed spec: the model's shape and its bytes per weight and gradient."""

    shape: GptShape
    param_bytes: int = OPTIONAL["param_bytes"]

    @property
    def text(self) -> str:
        """The spec as written, optional keys only where they differ from their defaults;
        :func:`parse_gpt_spec` reads it back to an equal spec."""
        s = self.shape
        values = {"layers": s.layers, "hidden": s.hidden, "heads": s.heads, "seq": s.seq,
                  "vocab": s.vocab, "batch": s.batch, "param_bytes": self.param_bytes}
        return SCHEME + ",".join(f"{k}={v}" for k, v in values.items()
                                 if k in _REQUIRED or v != OPTIONAL[k])


def is_gpt_spec(text: str | Path) -> bool:
    """Whether ``text`` names a profile by shape (``gpt:...``) rather than a file."""
    return str(text).startswith(SCHEME)


def parse_gpt_spec(text: str | Path) -> GptSpec:
    """The spec ``text`` writes; any mistake is a :class:`ProfileError` naming it."""
    spec = str(text)
    where = f"profile {spec!r}"
    if not is_gpt_spec(spec):
        raise ProfileError(f"{where} is not a profile by shape; write e.g. {EXAMPLE}")
    keys = (*_REQUIRED, *OPTIONAL)
    values: dict[str, int] = {}
    for item in spec.removeprefix(SCHEME).split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key:
            raise ProfileError(f"{where}: {item.strip()!r} is not KEY=VALUE; write e.g. {EXAMPLE}")
        if key not in keys:
            raise ProfileError(
                f"{where}: unknown key {key!r}; the keys are {', '.join(_REQUIRED)} (required) "
                f"and {', '.join(f'{k} (default {v})' for k, v in OPTIONAL.items())}")
        if key in values:
            raise ProfileError(f"{where} gives {key} twice; give it once")
        if not re.fullmatch(r"\d+", value) or int(value) < 1:
            raise ProfileError(f"{where}: {key}={value!r} is not a whole number >= 1; "
                               f"give e.g. {key}={OPTIONAL.get(key, 4)}")
        values[key] = int(value)
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise ProfileError(f"{where} misses {', '.join(missing)}; every one of "
                           f"{', '.join(_REQUIRED)} is needed, e.g. {EXAMPLE}")
    full = {**OPTIONAL, **values}
    hidden, heads = full["hidden"], full["heads"]
    if hidden % heads:
        raise ProfileError(
            f"{where}: heads={heads} does not divide hidden={hidden} (each head is "
            f"hidden / heads wide); give a head count that divides {hidden}, e.g. "
            f"{' or '.join(map(str, _divisors_near(hidden, heads)))}")
    if full["param_bytes"] not in _PARAM_BYTES:
        raise ProfileError(f"{where}: param_bytes={full['param_bytes']}; give 4 (32-bit "
                           "weights and gradients, the default) or 2 (16-bit)")
    shape = GptShape("", full["layers"], hidden, heads, full["seq"], full["vocab"],
                     full["batch"])
    parsed = GptSpec(shape, full["param_bytes"])
    return dataclasses.replace(parsed, shape=dataclasses.replace(shape, name=parsed.text))


def gpt_spec_profile(spec: GptSpec, device: Device, *, flops: float | None = None
                     ) -> LayerGraph:
    """The profile of ``spec`` on ``device``: matrix products at its sustained rate (or
    ``flops`` FLOP/s, a rate fitted to a measurement), what moves rather than multiplies
    at the same share of its memory bandwidth, named by the spec's text."""
    rate = device.sustained_flops if flops is None else flops
    graph = gpt_profile(spec.shape, rate, parameter_bytes=spec.param_bytes,
                        memory_bandwidth=device.sustained_bandwidth(rate))
    return dataclasses.replace(graph, model=spec.text,
                               meta={BY_SHAPE: spec.text, "shape_device": device.name})


def _divisors_near(n: int, k: int) -> list[int]:
    """The divisors of ``n`` nearest ``k`` from below and (within ``2 k``) from above."""
    below = next(d for d in range(min(k, n), 0, -1) if n % d == 0)
    above = next((d for d in range(k + 1, min(2 * k, n) + 1) if n % d == 0), None)
    return [below] if above is None else [below, above]


def by_shape(graph: LayerGraph) -> bool:
    """Whether ``graph`` was built from a shape rather than measured."""
    return BY_SHAPE in graph.meta

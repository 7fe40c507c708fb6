"""``--layout t8-p8[-v2][-z1][-r4]``: a synchronous plan's parallel layout, fixed by hand.

``t``: the workers of one server each replica of a stage is split over (tensor
parallelism); ``p``: the pipeline's stages; ``v``: virtual stages per worker
(interleaved 1F1B); ``z``: the ZeRO level replicated stages shard at (0-3); ``r``: the
blocks each stage recomputes, its first ``k`` (Megatron-LM's transformer layers; ``r0``
none, a stage holding fewer recomputes all of its own). Data
parallelism fills the workers left: ``d = workers // (t p)``. What the text leaves out
(``v``, the microbatch size, the cuts) the planner chooses. Parsing is strict: tokens in
this order, each once, whole numbers; a mistake is a :class:`~dreampipe.errors.ConfigError`
naming the text and the fix (docs/planner.md, "The synchronous objective").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dreampipe.errors import ConfigError

__all__ = ["LAYOUT_EXAMPLE", "Layout", "parse_layout"]

LAYOUT_EXAMPLE = "t8-p8-v2-z1-r4"
_ORDER = ("t", "p", "v", "z", "r")
_MEANING = {"t": "tensor-parallel workers", "p": "pipeline stages", "v": "virtual stages",
            "z": "ZeRO level", "r": "recomputed blocks per stage"}


@dataclass(frozen=True)
class Layout:
    """A parsed layout; None where the text leaves the choice to the planner."""

    t: int
    p: int
    v: int | None = None
    zero: int | None = None
    recompute_blocks: int | None = None

    @property
    def text(self) -> str:
        """The layout as written; :func:`parse_layout` reads it back to an equal one."""
        parts = [f"t{self.t}", f"p{self.p}"]
        parts += [f"v{self.v}"] if self.v is not None else []
        parts += [f"z{self.zero}"] if self.zero is not None else []
        parts += [f"r{self.recompute_blocks}"] if self.recompute_blocks is not None else []
        return "-".join(parts)


def parse_layout(text: str) -> Layout:
    """The layout ``text`` writes (module doc), or a ConfigError naming the mistake."""
    where = f"layout={text!r}"
    values: dict[str, int] = {}
    last = -1
    for token in text.strip().split("-"):
        found = re.fullmatch(r"([a-z])(\d+)", token.strip())
        if found is None or found.group(1) not in _ORDER:
            raise ConfigError(
                f"{where}: {token!r} is not one of t<N> ({_MEANING['t']}), p<N>, v<N>, z<L> or "
                f"r<K>; write e.g. {LAYOUT_EXAMPLE} or t1-p1", "layout")
        key, value = found.group(1), int(found.group(2))
        at = _ORDER.index(key)
        if key in values:
            raise ConfigError(f"{where} gives {key} twice; give each of t, p, v, z, r once",
                              "layout")
        if at < last:
            raise ConfigError(f"{where} gives {key} after {_ORDER[last]}; write them in the "
                              f"order t, p, v, z, r, e.g. {LAYOUT_EXAMPLE}", "layout")
        last = at
        if key == "z" and value > 3:
            raise ConfigError(f"{where}: z{value} is no ZeRO level; give z0, z1, z2 or z3",
                              "layout")
        if key not in ("z", "r") and value < 1:
            raise ConfigError(f"{where}: {key}{value}; the {_MEANING[key]} must be a whole "
                              f"number >= 1, e.g. {key}2", "layout")
        values[key] = value
    missing = [k for k in ("t", "p") if k not in values]
    if missing:
        raise ConfigError(f"{where} misses {' and '.join(missing)}; a layout names at least "
                          "the tensor-parallel workers and the pipeline stages, e.g. t8-p8 "
                          "(t1-p1: data parallelism only)", "layout")
    return Layout(values["t"], values["p"], values.get("v"), values.get("z"),
                  values.get("r"))

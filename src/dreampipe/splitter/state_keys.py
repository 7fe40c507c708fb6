"""Every key of the model's ``state_dict`` comes back, whichever stage holds it.

A stage holds the modules and attributes its segments call or read, under
their own names. Three kinds of key are held by no stage as they are:

- an *alias*: a second name of a tensor that a stage holds under another name
  (T5's ``shared`` and its ``embed_tokens``, ``self.b = self.a``);
- an *orphan*: a tensor the forward never reads (an unused module or
  buffer). The first segment adopts it, a parameter frozen (it gets no
  gradient in one process either), so it is saved, loaded and materialised;
- a buffer the top-level forward writes between blocks is read by the
  segment that writes it. If segments of more than one stage touch it,
  the copies would drift apart: a ConfigError names it before training.

:class:`StateKeys` puts the aliases back (docs/design.md §2.1).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from dreampipe.errors import ConfigError
from dreampipe.splitter.placing import fetch, place_attr
from dreampipe.splitter.segments import Segment

__all__ = ["StateKeys", "adopt_orphans", "check_written_buffers", "state_keys"]

_log = logging.getLogger(__name__)


def _groups(state: Mapping[str, Tensor]) -> dict[int, list[str]]:
    """The keys of ``state`` (kept as variables) grouped by the tensor they name."""
    out: dict[int, list[str]] = {}
    for key, t in state.items():
        out.setdefault(id(t), []).append(key)
    return out


@dataclass(frozen=True)
class StateKeys:
    """The model's keys in its order, and for each key no stage holds, the held key of
    the same tensor."""

    order: tuple[str, ...]
    aliases: tuple[tuple[str, str], ...]

    def complete(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` (what the stages hold) with every alias filled in, in the model's
        key order; keys the model lacks follow."""
        alias = dict(self.aliases)
        out = {k: state[k] if k in state else state[alias[k]] for k in self.order
               if k in state or alias.get(k) in state}
        out.update({k: v for k, v in state.items() if k not in out})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"order": list(self.order), "aliases": [list(a) for a in self.aliases]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StateKeys:
        return cls(tuple(d["order"]), tuple((a, b) for a, b in d["aliases"]))


def state_keys(model: nn.Module, held: set[str]) -> StateKeys:
    """``model``'s keys and the aliases of the keys of ``held`` (what the layers hold)."""
    state = model.state_dict(keep_vars=True)
    aliases = []
    for keys in _groups(state).values():
        source = next((k for k in keys if k in held), None)
        if source is not None:
            aliases += [(k, source) for k in keys if k not in held]
    return StateKeys(tuple(state), tuple(aliases))


def _orphan_roots(model: nn.Module, orphans: set[str]) -> list[str]:
    """Each orphan key, or the highest non-root module all of whose keys are orphans."""
    roots: list[str] = []
    for key in sorted(orphans):
        if any(key.startswith(f"{r}.") or key == r for r in roots):
            continue
        parts = key.split(".")
        for depth in range(1, len(parts)):
            path = ".".join(parts[:depth])
            module = model.get_submodule(path)
            if set(module.state_dict(prefix=f"{path}.")) <= orphans:
                roots.append(path)
                break
        else:
            roots.append(key)
    return roots


def _frozen(value: Any) -> Any:
    """An orphan as the first stage holds it: a parameter (of a copied module) frozen."""
    if isinstance(value, nn.Module):
        value = copy.deepcopy(value)
        value.requires_grad_(False)
        return value
    if isinstance(value, nn.Parameter):
        return nn.Parameter(value.detach(), requires_grad=False)
    return value


def adopt_orphans(model: nn.Module, layers: Sequence[tuple[str, nn.Module]],
                  held: set[str]) -> list[str]:
    """Give the first segment every tensor of ``model``'s state that no layer holds under
    any name (``held``: the keys they hold; see the docstring); the names adopted. An
    ``nn.Sequential``'s layers are its own children: what they miss is only logged."""
    state = model.state_dict(keep_vars=True)
    orphans = {k for keys in _groups(state).values() if not held & set(keys) for k in keys}
    if not orphans:
        return []
    first = layers[0][1]
    if not isinstance(first, Segment):
        _log.warning("no stage holds %s of %s: full_state_dict() and checkpoints leave them "
                     "out", sorted(orphans), type(model).__name__)
        return []
    roots = _orphan_roots(model, orphans)
    for root in roots:
        place_attr(model, root, first, _frozen(fetch(model, root)))
        first.targets.append(root)
    _log.info("the first stage keeps %s, which %s's forward never reads", roots,
              type(model).__name__)
    return roots


def check_written_buffers(layers: Sequence[tuple[str, nn.Module]],
                          bounds: Sequence[int]) -> None:
    """A buffer the top-level forward writes must be touched by one stage's segments only
    (stages begin at ``bounds``); a ConfigError naming it and the fix otherwise."""
    edges = [*bounds, len(layers)]
    stage_of = {i: s for s in range(len(bounds)) for i in range(edges[s], edges[s + 1])}
    for i, (_, layer) in enumerate(layers):
        if not isinstance(layer, Segment):
            continue
        for target in layer.written:
            touching = [j for j, (_, other) in enumerate(layers)
                        if isinstance(other, Segment) and target in other.targets]
            users = sorted({stage_of[j] for j in touching})
            if len(users) > 1:
                names = [layers[j][0] for j in touching]
                raise ConfigError(
                    f"buffer {target!r} is written by the model's forward before "
                    f"{layers[i][0]!r} and used before {', '.join(map(repr, names))}, on "
                    f"stages {', '.join(map(str, users))}: each stage would keep its own "
                    f"copy; choose split points that keep those on one stage, or move the "
                    f"buffer's update into a block", "plan")

"""A stage of a model built on ``meta``, materialised with the model's own initialisation.

Each rank gives only its stage's layers storage (``to_empty``), then runs, layer
by layer under ``torch.manual_seed(seed + layer index)``, the initialisation the
model brings: a Hugging Face model's ``_init_weights`` (what ``post_init`` runs)
on every submodule, or else each submodule's ``reset_parameters()``. So the
initial weights depend on the seed and the layer, never on the plan.

Storage starts as NaN: a parameter or floating-point buffer still NaN after
initialisation belongs to a module with no way to initialise itself, a
PlanError naming it before training, never uninitialised memory. Weights
shared inside the stage stay shared.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dreampipe.errors import PlanError

__all__ = ["Initialiser", "initialiser", "materialise"]


class Initialiser:
    """A model's own per-module initialisation (Hugging Face's ``_init_weights``);
    copies of the layers share it (it holds the model)."""

    def __init__(self, init: Callable[[nn.Module], None]) -> None:
        self._init = init

    def __call__(self, module: nn.Module) -> None:
        self._init(module)

    def __deepcopy__(self, memo: dict[int, Any]) -> Initialiser:
        return self


def initialiser(model: nn.Module) -> Initialiser | None:
    """``model``'s own initialisation, if it has one (a Hugging Face ``PreTrainedModel``)."""
    init = getattr(model, "_init_weights", None)
    return Initialiser(init) if callable(init) and hasattr(model, "config") else None


def _places(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Where each parameter is registered (several places: a tied weight)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, name))
    return places


def _own(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in (*module._parameters.items(), *module._buffers.items())
            if t is not None]


def materialise(stage: nn.Module, layers: list[tuple[str, nn.Module]], first: int,
                device: torch.device, seed: int) -> None:
    """Give ``stage`` (holding ``layers``, model layers ``first..``) storage on ``device``
    and initialise it as the module docstring says."""
    tied = [p for p in _places(stage).values() if len(p) > 1]
    stage.to_empty(device=device)
    for group in tied:
        module, name = group[0]
        for other, other_name in group[1:]:
            other._parameters[other_name] = module._parameters[name]
    # the seeds below reach the stage's CUDA generator too: restore it as well as the CPU's
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        for t in (*stage.parameters(), *stage.buffers()):
            if t.is_floating_point():
                t.fill_(math.nan)
        for i, (_, layer) in enumerate(layers):
            torch.manual_seed(seed + first + i)
            init = getattr(layer, "initialiser", None)
            for sub in layer.modules():
                if isinstance(init, Initialiser):
                    init(sub)
                elif _own(sub) and callable(reset := getattr(sub, "reset_parameters", None)):
                    reset()
    for fqn, sub in stage.named_modules():
        bad = [n for n, t in _own(sub) if t.is_floating_point() and bool(t.isnan().any())]
        if bad:
            raise PlanError(
                f"module {fqn!r} ({type(sub).__name__}) was built on meta and has no way to "
                f"initialise {', '.join(map(repr, bad))}: give it reset_parameters() (or "
                "_init_weights in a Hugging Face model), or build the model on a real device")

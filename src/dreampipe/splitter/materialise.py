"""Layers initialised by dreampipe's rule: the model's own initialisation, per-layer seeds.

Layer ``i`` of a model built on ``meta`` is initialised under seed
``seed + i`` on the CPU generator by the model's own initialisation, so its
weights depend on the seed and the layer, never on the plan or the device.
:func:`materialise` runs one layer at a time; a tensor still NaN after
initialisation is a PlanError naming its module. Weights shared inside a
stage stay shared. The rule and why: docs/design.md §2.1.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dreampipe.errors import PlanError

__all__ = ["Initialiser", "initialise_layers", "initialiser", "materialise"]

#: What becomes of a layer's freshly initialised CPU tensor: ``land(original, cpu)``
#: returns the tensor the model holds from then on.
Land = Callable[[Tensor, Tensor], Tensor]


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
    """``model``'s own initialisation, if it has one: an ``_init_weights(module)`` that
    ``model.apply`` would call (a Hugging Face ``PreTrainedModel``'s, nanoGPT's)."""
    init = getattr(model, "_init_weights", None)
    if not callable(init):
        return None
    try:
        inspect.signature(init).bind(model)
    except (TypeError, ValueError):  # not one module at a time
        return None
    return Initialiser(init)


def _own(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [(n, t) for n, t in (*module._parameters.items(), *module._buffers.items())
            if t is not None]


def _put(module: nn.Module, name: str, value: Tensor) -> None:
    if name in module._parameters:
        module._parameters[name] = value  # type: ignore[assignment]
    else:
        module._buffers[name] = value


def _children_first(root: nn.Module) -> list[nn.Module]:
    """``root``'s modules, each after its children (the order ``nn.Module.apply`` runs)."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen:
                visit(child)
        out.append(module)

    visit(root)
    return out


def _initialise(layer: nn.Module, seed: int, names: dict[int, str],
                done: dict[int, Tensor], land: Land) -> None:
    """Initialise ``layer`` on CPU tensors under ``seed``; each tensor not in ``done``
    (by id) lands (``land``), one already there keeps its value."""
    slots = [(sub, n, t) for sub in layer.modules() for n, t in _own(sub)]
    fresh: dict[int, Tensor] = {}
    held: dict[int, Tensor] = {}
    blank: dict[int, int] = {}  # a meta tensor's stand-in, not NaN-able: its version
    for sub, n, t in slots:
        if id(t) not in fresh:
            if t.device.type != "meta":  # its values are known: kept where nothing resets them
                cpu = t.detach().to("cpu", copy=True)
            else:
                cpu = torch.empty(t.shape, dtype=t.dtype)
                if cpu.is_floating_point():
                    cpu.fill_(math.nan)
                else:
                    blank[id(cpu)] = cpu._version
            fresh[id(t)] = cpu
            held[id(t)] = nn.Parameter(cpu, t.requires_grad) if isinstance(
                t, nn.Parameter) else cpu
        _put(sub, n, held[id(t)])
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.default_generator.manual_seed(seed)
        init = getattr(layer, "initialiser", None)
        for sub in _children_first(layer):
            if isinstance(init, Initialiser):
                init(sub)
            elif _own(sub) and callable(reset := getattr(sub, "reset_parameters", None)):
                reset()
    for sub, n, t in slots:
        now = dict(_own(sub))[n]
        if now is not held[id(t)]:  # the initialisation set a new tensor, not filled ours
            fresh[id(t)] = now.detach()
    for sub, n, t in slots:
        if id(t) not in done:
            cpu = fresh[id(t)]
            unset = blank.get(id(cpu)) == cpu._version  # an integer or bool nobody wrote
            if unset or (cpu.is_floating_point() and bool(cpu.isnan().any())):
                where = names.get(id(sub), "")
                holder = (f"module {where!r} ({type(sub).__name__})" if where else
                          "the model (its own tensor, outside its submodules)")
                raise PlanError(
                    f"{holder} was built on meta and has no way to initialise {n!r}"
                    f"{'' if cpu.is_floating_point() else f' ({cpu.dtype})'}: give it "
                    "reset_parameters() (or the model an _init_weights(module)), or build the "
                    "model on a real device")
            done[id(t)] = landed = land(t, cpu)
            done[id(landed)] = landed
        _put(sub, n, done[id(t)])


def initialise_layers(root: nn.Module, layers: Sequence[tuple[str, nn.Module]], first: int,
                      seed: int, land: Land) -> None:
    """Initialise ``layers`` (model layers ``first..``, held by ``root``) by the rule of
    the module docstring, one after the other, each fresh tensor landing by ``land``;
    then every module of ``root`` holds the landed tensors."""
    names = {id(m): n for n, m in root.named_modules()}
    done: dict[int, Tensor] = {}
    for i, (_, layer) in enumerate(layers):
        own = {id(m): n for n, m in layer.named_modules()}  # a segment's: the model's FQNs
        _initialise(layer, seed + first + i, {**own, **names}, done, land)
    for module in root.modules():
        for n, t in _own(module):
            if id(t) in done:
                _put(module, n, done[id(t)])


def materialise(stage: nn.Module, layers: Sequence[tuple[str, nn.Module]], first: int,
                device: torch.device, seed: int) -> None:
    """Give ``stage`` (holding ``layers``, model layers ``first..``) storage on ``device``,
    initialised layer by layer as the module docstring says."""

    def land(original: Tensor, cpu: Tensor) -> Tensor:
        moved = cpu.to(device)
        return nn.Parameter(moved, original.requires_grad) if isinstance(
            original, nn.Parameter) else moved

    initialise_layers(stage, layers, first, seed, land)

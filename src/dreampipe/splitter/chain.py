"""A user's model as a list of layers, and one pipeline stage built from it.

An ``nn.Sequential`` is cut between its children (or one segment per child,
:mod:`.sequential`); any other module into the segments of its traced
forward (:mod:`.trace`, :mod:`.pack`). A model that cannot be traced is a
:class:`~dreampipe.errors.PlanError`. A stage (:func:`build_stage`) holds its
layers' modules under their original names, so a state dict moves between
plans and into the plain model unchanged; a weight tied across stages is
held by each (:func:`tied_parameters`). A model on ``meta`` is materialised
stage by stage (:mod:`.materialise`); :func:`initialise` gives a model built
on a device the same weights. See docs/design.md §2.1.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dreampipe.errors import ConfigError, PlanError
from dreampipe.planning.splits import Split
from dreampipe.runtime.tensor_split import SplitStage, shard_linear
from dreampipe.splitter.materialise import initialise_layers, materialise
from dreampipe.splitter.pack import pack, unpack_signed
from dreampipe.splitter.placing import fetch, place, place_attr
from dreampipe.splitter.segments import Segment, segments, unit_names
from dreampipe.splitter.sequential import passes_one_tensor, sequential_entries, sequential_segments
from dreampipe.splitter.state_keys import adopt_orphans

__all__ = [
    "Chain", "Layers", "Tie", "build_split_stage", "build_stage", "held_keys", "hold_apart",
    "initialise", "is_meta", "split_layers", "tied_parameters",
]

#: A model's layers in call order: ``(qualified name, module)``.
Layers = list[tuple[str, nn.Module]]


class Chain(nn.Module):
    """Layers called one after the other, registered under their original qualified names.

    Layers that are :class:`~dreampipe.splitter.segments.Segment`\\ s of a traced model
    run against the chain, which holds their units and attributes under their
    FQNs. A chain that starts after the model's first segment takes the packed
    values the previous stage sent (:mod:`.pack`); one that ends before the
    last segment packs what it passes on, with the signature of the model's
    inputs when the segments' graphs depend on their shapes (:mod:`.shapes`).
    The first segment takes the model's inputs: positional ones, or one dict
    of keyword arguments (``model(**x)``).
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        for name, module in layers:
            if isinstance(module, Segment):
                for target in module.targets:
                    if not _holds(self, target):
                        place_attr(module, target, self, fetch(module, target))
            else:
                place(name, self, module)
        # a private name: a model's own top-level module may be called ``layers`` (Llama's)
        self._stage_layers = tuple(module for _, module in layers)
        #: The 16-bit dtype a run sends in, which a pack takes where it is exact (:mod:`.pack`).
        self.message_dtype: torch.dtype | None = None

    @property
    def stage_layers(self) -> tuple[nn.Module, ...]:
        """The chain's layers, in call order."""
        return self._stage_layers

    def forward(self, *args: Any) -> Any:
        """The first layer on the inputs, then each next layer on the previous output."""
        first = self._stage_layers[0]
        if not isinstance(first, Segment):
            out = first(*args)
            for layer in self._stage_layers[1:]:
                out = layer(out)
            return out
        if first.index > 0:
            values, sig = unpack_signed(args[0])
        else:
            values = first.bind(args)
            sig = first.signature(values)
        for seg in self._stage_layers:
            assert isinstance(seg, Segment)
            values = seg.run(self, values, sig)
        last = self._stage_layers[-1]
        assert isinstance(last, Segment)
        if last.index < last.count - 1:
            return pack(values, f"the cut after {last.name!r}", sig, self.message_dtype)
        return values


def _holds(module: nn.Module, target: str) -> bool:
    value: Any = module
    for part in target.split("."):
        if not hasattr(value, part):
            return False
        value = getattr(value, part)
    return True


def split_layers(model: nn.Module, example: Any = None) -> Layers:
    """``model`` as its layers: an ``nn.Sequential``'s children (:mod:`.sequential`), or the
    segments of any other module traced around its units on ``example``, one unit of its
    input (a tensor, tuple or dict; None: no shapes known) (:mod:`.trace`); a PlanError
    saying why not."""
    if isinstance(model, nn.Sequential):
        layers = sequential_entries(model)
        if not layers:
            raise PlanError("the nn.Sequential model is empty; give it at least one layer")
        if passes_one_tensor(model, example):
            return layers
        layers = list(sequential_segments(model, example))
    else:
        layers = list(segments(model, unit_names(model), example))
    adopt_orphans(model, layers, held_keys(layers))
    return layers


def held_keys(layers: Layers) -> set[str]:
    """The state-dict keys ``layers`` hold (a stage of all of them)."""
    return set(Chain(layers).state_dict(keep_vars=True))


@dataclass(frozen=True)
class Tie:
    """One parameter shared by layers of several stages: each stage's name for it."""

    stages: tuple[int, ...]
    names: tuple[str, ...]


def tied_parameters(layers: Layers, bounds: Sequence[int]) -> list[Tie]:
    """The parameters used by layers of more than one stage (stages begin at ``bounds``),
    in the order the layers first use them, each with its name in each stage."""
    edges = [*bounds, len(layers)]
    named: list[dict[int, str]] = []
    for s in range(len(bounds)):
        stage = Chain(layers[edges[s] : edges[s + 1]])
        named.append({id(p): n for n, p in reversed(list(
            stage.named_parameters(remove_duplicate=False)))})
    order: list[int] = []
    for names in named:
        order += [k for k in names if k not in order]
    ties = []
    for key in order:
        stages = tuple(s for s, names in enumerate(named) if key in names)
        if len(stages) > 1:
            ties.append(Tie(stages, tuple(named[s][key] for s in stages)))
    return ties


def hold_apart(stages: Sequence[nn.Module]) -> None:
    """Give each of one rank's ``stages`` (in order) its own copy of every module and
    parameter an earlier one holds, in place of it: a weight tied across two stages of a
    rank (interleaving) is then two copies that each stage steps, as on two ranks."""
    modules: set[int] = set()
    params: set[int] = set()
    for stage in stages:
        memo: dict[int, Any] = {}
        for p in stage.parameters():
            if id(p) in params and id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().clone(), p.requires_grad)
        _replace_held(stage, modules, memo)
        modules.update(id(m) for m in stage.modules())
        params.update(id(p) for p in stage.parameters())


def _replace_held(module: nn.Module, held: set[int], memo: dict[int, Any]) -> None:
    """Replace in ``module``'s tree each child in ``held`` by a deep copy, and each
    parameter in ``memo`` by its copy there (which the deep copies share)."""
    for name, child in list(module._modules.items()):
        if child is not None and id(child) in held:
            module._modules[name] = copy.deepcopy(child, memo)
        elif child is not None:
            _replace_held(child, held, memo)
    for name, p in list(module._parameters.items()):
        if p is not None and id(p) in memo:
            module._parameters[name] = memo[id(p)]


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def build_stage(
    layers: Layers, first: int, last: int, device: torch.device, seed: int = 0
) -> Chain:
    """Layers ``first..last`` on ``device``, materialised from meta by the model's own
    initialisation under per-layer seeds (:mod:`.materialise`). Each module keeps the
    mode the model gave it, as one process trains it: a BatchNorm the user put in eval
    mode keeps its running statistics frozen."""
    stage = Chain(layers[first : last + 1])
    if is_meta(stage):
        materialise(stage, layers[first : last + 1], first, device, seed)
    return stage.to(device)


def initialise(model: nn.Module, example: Any = None, seed: int = 0) -> nn.Module:
    """Initialise ``model`` in place, on the device it is on, to the weights a Pipeline
    gives it when it is built on ``meta`` with ``seed`` (the rule of :mod:`.materialise`);
    ``example`` is one input of the model as the Pipeline's example has it (a tensor, a
    tuple or a dict of keyword arguments), to trace a model that is not an
    ``nn.Sequential``. Returns ``model``."""
    if is_meta(model):
        raise ConfigError(f"{type(model).__name__} is on the meta device; initialise builds "
                          "nothing: give it to the Pipeline as it is, which materialises it "
                          "with these weights, or build it on a device", "model")

    def land(original: torch.Tensor, cpu: torch.Tensor) -> torch.Tensor:
        original.data.copy_(cpu)
        return original

    initialise_layers(model, split_layers(model, example), 0, seed, land)
    return model


def build_split_stage(
    layers: Layers, first: int, last: int, splits: Sequence[Split], mesh: DeviceMesh,
    device: torch.device, seed: int = 0,
) -> SplitStage:
    """Layers ``first..last`` split over ``mesh`` as ``splits`` says, each worker holding
    its share: a layer on meta that is one ``nn.Linear`` split by rows or columns is drawn
    share by share (:func:`~dreampipe.runtime.tensor_split.shard_linear`); any other is
    built whole, as :func:`build_stage` does, then divided."""
    for i, split in zip(range(first, last + 1), splits, strict=True):
        layer = layers[i][1]
        holders = [m for m in layer.modules() if any(True for _ in m.parameters(recurse=False))]
        if (split in (Split.OUT, Split.IN) and is_meta(layer) and not any(True for _ in
                layer.buffers()) and len(holders) == 1 and isinstance(holders[0], nn.Linear)):
            shard_linear(holders[0], split, mesh, seed + i, device)
        else:
            build_stage(layers, i, i, device, seed)
    return SplitStage(Chain(layers[first : last + 1]), splits, mesh)

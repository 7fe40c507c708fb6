"""A user's model as a chain of layers, and one pipeline stage built from it.

dreampipe cuts a model between layers, so it needs the model as a chain:

- an ``nn.Sequential``: its children, in order;
- any other module that ``torch.fx`` can trace and whose top-level graph is
  a chain of submodule calls (the first takes the model's inputs, each next
  one the previous output, the last one's output is returned).

Anything else is a :class:`~dreampipe.errors.PlanError` naming the module and
the node that breaks the chain. A stage (:func:`build_stage`) holds its
layers under their original names, so its parameter names (``3.weight``,
``blocks.0.attn.proj.weight``) are the model's own and a state dict moves
between plans and into the plain model unchanged.

A model built on the ``meta`` device is materialised stage by stage: each
layer gets empty storage (``to_empty``) and then ``reset_parameters()`` of
each of its submodules that has one, under ``torch.manual_seed(seed + i)``
for layer ``i``; so the initial weights come from a per-layer seed, the same
on any plan. Buffers a layer does not reset there are left uninitialised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dreampipe.errors import PlanError
from dreampipe.planning.splits import Split
from dreampipe.runtime.tensor_split import SplitStage, shard_linear

__all__ = ["Chain", "Layers", "build_split_stage", "build_stage", "is_meta", "split_layers"]

#: A model's layers in call order: ``(qualified name, module)``.
Layers = list[tuple[str, nn.Module]]


class Chain(nn.Module):
    """Layers called one after the other, registered under their original qualified names."""

    def __init__(self, layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        for name, module in layers:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                child = parent._modules.get(part)
                if child is None:
                    child = nn.Module()
                    parent.add_module(part, child)
                parent = child
            parent.add_module(leaf, module)
        self.layers = tuple(module for _, module in layers)

    def forward(self, *args: Any) -> Any:
        """The first layer on the inputs, then each next layer on the previous output."""
        out = self.layers[0](*args)
        for layer in self.layers[1:]:
            out = layer(out)
        return out


def split_layers(model: nn.Module) -> Layers:
    """``model`` as its chain of layers, or a PlanError saying why it is not one."""
    if isinstance(model, nn.Sequential):
        layers = list(model.named_children())
        if not layers:
            raise PlanError("the nn.Sequential model is empty; give it at least one layer")
        return layers
    return _traced_chain(model)


def _traced_chain(model: nn.Module) -> Layers:
    import torch.fx

    what = type(model).__name__
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception as exc:
        raise PlanError(
            f"cannot split {what}: torch.fx cannot trace it ({type(exc).__name__}: {exc}); "
            "give an nn.Sequential, or a module whose forward only calls its submodules "
            "one after the other"
        ) from exc
    layers: Layers = []
    prev: tuple[Any, ...] = tuple(n for n in graph.nodes if n.op == "placeholder")
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            if node.args != (prev[0],) or not layers:
                raise PlanError(f"cannot split {what}: its forward does not return the last "
                                "layer's output; make the last submodule call the result")
            break
        if node.op != "call_module" or tuple(node.args) != prev or node.kwargs:
            target = getattr(node.target, "__name__", node.target)
            raise PlanError(
                f"cannot split {what} at node {node.name!r} ({node.op} {target}): dreampipe cuts "
                "a chain of submodule calls, each taking the previous one's output; move that "
                "computation into a submodule, or give an nn.Sequential"
            )
        layers.append((str(node.target), model.get_submodule(str(node.target))))
        prev = (node,)
    return layers


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def build_stage(
    layers: Layers, first: int, last: int, device: torch.device, seed: int = 0
) -> Chain:
    """Layers ``first..last`` on ``device``, materialised from meta by per-layer seeds."""
    stage = Chain(layers[first : last + 1])
    if is_meta(stage):
        stage.to_empty(device=device)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for i in range(first, last + 1):
                torch.manual_seed(seed + i)
                for sub in layers[i][1].modules():
                    reset = getattr(sub, "reset_parameters", None)
                    if callable(reset):
                        reset()
    return stage.to(device).train()


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

"""A tensor-split stage: its layers' weights divided over ``t`` workers with DTensor.

The plan says, per layer, how its tensors are divided
(:class:`~dreampipe.planning.splits.Split`); here that becomes DTensor
placements on a 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` of the
stage's ``t`` workers, and the layout each layer reads its input in
(docs/design.md §10.4). DTensor runs the collectives. The stage reads and
returns plain tensors, replicated on its workers, so the pipeline around it,
its schedules and weight stashing, are unchanged.

``torch.distributed.tensor`` is imported on first use: its import is slow,
and most runs split no tensor.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dreampipe.errors import PlanError
from dreampipe.planning.splits import Split, is_elementwise

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

__all__ = ["SplitStage", "check_split_layers", "full_state", "shard_linear", "tensor_mesh"]

_BLOCKS = 8  # blocks of rows per share that shard_linear draws at a time
_WEIGHT_SPLITS = (Split.OUT, Split.IN)  # the splits that divide a Linear's weights


def _input_placement(split: Split, features: bool = False) -> Placement:
    """The layout a layer of ``split`` reads its input in; ``features``: an elementwise
    layer that the plan splits ``out`` passes features split over workers through."""
    from torch.distributed.tensor import Replicate, Shard

    if split is Split.BATCH:
        return Shard(0)
    return Shard(-1) if split is Split.IN or features else Replicate()


def _passes_features(layer: nn.Module, split: Split) -> bool:
    """An ``out`` split of a layer without a Linear that acts on each value alone (the
    planner's elementwise layers, :func:`~dreampipe.planning.splits.is_elementwise`): it
    keeps the previous layer's features split, as the planner prices it."""
    return split is Split.OUT and not any(isinstance(m, nn.Linear) for m in layer.modules()) \
        and is_elementwise(repr(layer))


def _weight_placements(split: Split) -> tuple[Placement, Placement]:
    """A Linear's (weight, bias) placements under ``split``, one of ``_WEIGHT_SPLITS``."""
    from torch.distributed.tensor import Replicate, Shard

    return (Shard(0), Shard(0)) if split is Split.OUT else (Shard(1), Replicate())


def tensor_mesh(world: int, t: int, device_type: str) -> DeviceMesh:
    """The mesh of this worker's replica: workers ``r*t .. r*t+t-1`` of ``world``.

    A collective: every worker builds the whole (replicas x t) mesh.
    """
    grid = init_device_mesh(device_type, (world // t, t), mesh_dim_names=("replica", "tensor"))
    return grid["tensor"]


class SplitStage(nn.Module):
    """``layers``' children (one per planned layer, same names) split over ``mesh`` as
    ``splits`` says."""

    def __init__(self, layers: nn.Module, splits: Sequence[Split], mesh: DeviceMesh) -> None:
        super().__init__()
        children = list(layers.named_children())
        if len(children) != len(splits):
            raise PlanError(
                f"a split stage of {len(children)} layers got {len(splits)} splits; the plan "
                "must give one split per layer"
            )
        check_split_layers(children, splits)
        for name, layer in children:
            self.add_module(name, layer)
        self.mesh = mesh
        self._inputs = [(_input_placement(s, _passes_features(layer, s)),)
                        for (_, layer), s in zip(children, splits, strict=True)]
        for (name, layer), split in zip(children, splits, strict=True):
            _distribute(name, layer, split, mesh)

    def forward(self, x: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        h: Any = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        for layer, placement in zip(self.children(), self._inputs, strict=True):
            if tuple(h.placements) != placement:
                h = h.redistribute(self.mesh, placement)
            h = layer(h)
        out: Tensor = h.redistribute(self.mesh, [Replicate()]).to_local()
        return out


def check_split_layers(layers: Sequence[tuple[str, nn.Module]], splits: Sequence[Split],
                       stage: int | None = None) -> None:
    """What a split stage of ``layers`` cannot hold, each a PlanError naming the fix: a
    weight split of a layer that is not one Linear (nor elementwise), a buffer (DTensor
    ops refuse plain tensors beside split ones, and a ``batch`` split would keep
    statistics of part of each microbatch), a tensor held under two names (each name
    would become a tensor of its own: the tie comes apart, or is stepped twice)."""
    names: dict[int, str] = {}
    where = "a split stage" if stage is None else f"split stage {stage}"
    for (name, layer), split in zip(layers, splits, strict=True):
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        if split in _WEIGHT_SPLITS and len(linears) != 1 and not _passes_features(layer, split):
            raise PlanError(
                f"layer {name!r} ({type(layer).__name__}) of {where} has "
                f"{len(linears)} Linear modules; split {split.value} divides the weights of "
                "exactly one, so plan it as replica or batch, or on a stage with no split")
        buffer = next((b for b, _ in layer.named_buffers()), None)
        if buffer is not None:
            raise PlanError(
                f"layer {name!r} ({type(layer).__name__}) of {where} holds the "
                f"buffer {buffer!r}, which a split stage cannot keep yet; plan that layer on "
                "a stage with no split")
        for module_name, module in layer.named_modules():
            for key, p in module.named_parameters(recurse=False):
                full = ".".join(x for x in (name, module_name, key) if x)
                first = names.setdefault(id(p), full)
                if first != full:
                    raise PlanError(
                        f"parameter {first!r} is tied to {full!r} on {where}; a "
                        "split stage keeps no tie yet: plan the tied layers on a stage with "
                        "no split")


def _distribute(name: str, layer: nn.Module, split: Split, mesh: DeviceMesh) -> None:
    """Turn ``layer``'s parameters into DTensors placed for ``split``
    (:func:`check_split_layers` holds)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    placed: dict[int, Placement] = {}
    if split in _WEIGHT_SPLITS and linears:
        weight, bias = _weight_placements(split)
        placed[id(linears[0].weight)] = weight
        if linears[0].bias is not None:
            placed[id(linears[0].bias)] = bias
    for module in layer.modules():
        for key, p in list(module.named_parameters(recurse=False)):
            if isinstance(p.data, DTensor):  # shard_linear made it
                continue
            where = placed.get(id(p), Replicate())
            setattr(module, key, nn.Parameter(distribute_tensor(p.data, mesh, [where]),
                                              requires_grad=p.requires_grad))


def shard_linear(linear: nn.Linear, split: Split, mesh: DeviceMesh, seed: int,
                 device: torch.device) -> None:
    """Give ``linear`` (on meta) this worker's share of the weights ``reset_parameters``
    draws after ``torch.manual_seed(seed)``, never holding the whole weight.

    The CPU generator draws a tensor's elements in order, so drawing the rows
    in blocks, in order, gives the same values as one draw of the whole: each
    worker draws every block and keeps its rows (``OUT``) or columns (``IN``)
    of it. A worker holds its share plus one block of ``out / (8 t)`` rows.
    """
    from torch.distributed.tensor import DTensor

    out_f, in_f = linear.out_features, linear.in_features
    t, k = mesh.size(), mesh.get_local_rank()
    rows = _chunks(out_f, t)
    lo, hi = rows[k] if split is Split.OUT else _chunks(in_f, t)[k]
    weight = torch.empty(hi - lo, in_f) if split is Split.OUT else torch.empty(out_f, hi - lo)
    step = max(1, -(-out_f // (_BLOCKS * t)))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        bound = math.sqrt(3.0) * nn.init.calculate_gain("leaky_relu", math.sqrt(5)) / math.sqrt(
            max(in_f, 1))
        for a in range(0, out_f, step):
            b = min(a + step, out_f)
            block = torch.empty(b - a, in_f).uniform_(-bound, bound)
            if split is Split.IN:
                weight[a:b] = block[:, lo:hi]
            elif a < hi and b > lo:
                weight[max(a, lo) - lo : min(b, hi) - lo] = block[max(a, lo) - a : min(b, hi) - a]
        bias = None
        if linear.bias is not None:
            edge = 1.0 / math.sqrt(in_f) if in_f > 0 else 0.0
            bias = torch.empty(out_f).uniform_(-edge, edge)
    w_place, b_place = _weight_placements(split)
    linear.weight = nn.Parameter(DTensor.from_local(
        weight.to(device), mesh, [w_place], run_check=False, shape=torch.Size((out_f, in_f)),
        stride=(in_f, 1)))
    if bias is not None:
        a, b = (lo, hi) if split is Split.OUT else (0, out_f)
        linear.bias = nn.Parameter(DTensor.from_local(
            bias[a:b].clone().to(device), mesh, [b_place], run_check=False,
            shape=torch.Size((out_f,)), stride=(1,)))


def _chunks(n: int, t: int) -> list[tuple[int, int]]:
    """Where ``torch.chunk`` (DTensor's ``Shard``) cuts ``n`` into ``t`` pieces, empty ones last."""
    size = -(-n // t)
    return [(min(j * size, n), min((j + 1) * size, n)) for j in range(t)]


def full_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A module's ``state`` with every DTensor gathered whole (a collective over its mesh).

    No DTensor exists before ``torch.distributed.tensor`` is imported, so a
    process that never imported it has none to gather.
    """
    loaded = sys.modules.get("torch.distributed.tensor")
    if loaded is None:
        return dict(state)
    return {k: v.full_tensor() if isinstance(v, loaded.DTensor) else v
            for k, v in state.items()}

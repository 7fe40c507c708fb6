"""What a layer of a tensor-split stage costs beyond its share of the compute.

A split stage (:mod:`~dreampipe.runtime.tensor_split`) runs every layer through
DTensor: each operator on a DTensor propagates its sharding, checks and wraps
its result, and plans its redistributions on the host, whatever the layer's
size. The layer profile times plain layers and the operator search prices the
split share of their compute and the collectives' bytes, so that fixed part is
priced nowhere else. It is measured here on the workers of one node: a chain
of small ``Linear + ReLU`` layers split as the operator search splits an MLP
(``out``, ``in``, alternating, Megatron-LM's pair) is timed at two lengths,
forward and backward apart, beside the same plain chain, in turns. Per layer,
the split chain's extra time is :class:`SplitLayerCost` (docs/design.md §9.1).
It holds the latency of the small collectives the chain runs, which the search
adds again: microseconds against milliseconds. Timed alone on a busy host, a
collective holds the ranks' skew as well, more than the figure itself.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dreampipe.machine.timers import Timer

__all__ = ["ChainTimes", "SplitLayerCost", "measure_split_chains", "split_layer_cost"]

#: The probe chain's width and batch: small, so that compute is negligible beside the fixed part.
_WIDTH, _BATCH = 16, 8
#: The chain lengths timed (even: whole ``out``/``in`` pairs).
_LENGTHS = (2, 8)


@dataclass(frozen=True)
class SplitLayerCost:
    """Seconds one layer of a split stage spends beyond its share of the compute, in a
    forward and in a backward, per microbatch."""

    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class ChainTimes:
    """Median seconds of a chain of ``layers`` layers (forward, backward), split and plain."""

    layers: int
    split_forward_s: float
    split_backward_s: float
    plain_forward_s: float
    plain_backward_s: float


def split_layer_cost(short: ChainTimes, long: ChainTimes) -> SplitLayerCost:
    """The fixed cost per split layer from chains of two lengths: the slope of the split
    chain's time over its length less the plain chain's, which drops what each chain
    pays once (its input's and output's layouts). Never below 0: a host busier while
    the plain chains ran cannot make split layers cheaper."""
    extra = long.layers - short.layers
    if extra <= 0:
        raise ValueError(f"chains of {short.layers} and {long.layers} layers: the second "
                         "must be longer")

    def slope(split: float, plain: float) -> float:
        return max(0.0, (split - plain) / extra)

    return SplitLayerCost(
        forward_s=slope(long.split_forward_s - short.split_forward_s,
                        long.plain_forward_s - short.plain_forward_s),
        backward_s=slope(long.split_backward_s - short.split_backward_s,
                         long.plain_backward_s - short.plain_backward_s))


def measure_split_chains(group: Any, device: torch.device, timer: Timer, rounds: int
                         ) -> list[ChainTimes]:
    """Each of the chains (:data:`_LENGTHS`) timed on the members of ``group`` (a collective
    of them all), ``rounds`` timed rounds after two untimed. Each round times every chain,
    split and plain, in turn, so that a busy host's drift hits them alike."""
    from torch.distributed.device_mesh import DeviceMesh

    from dreampipe.planning.splits import Split
    from dreampipe.runtime.tensor_split import SplitStage

    mesh = DeviceMesh.from_group(group, device.type)
    x = torch.randn(_BATCH, _WIDTH, device=device)
    splits = [SplitStage(_chain(n, device), [Split.OUT, Split.IN] * (n // 2), mesh)
              for n in _LENGTHS]
    modules = [m for pair in zip(splits, (_chain(n, device) for n in _LENGTHS), strict=True)
               for m in pair]
    times: list[list[tuple[float, float]]] = [[] for _ in modules]
    for i in range(rounds + 2):
        passes = [_one_pass(m, x, timer, group) for m in modules]
        if i >= 2:
            for kept, took in zip(times, passes, strict=True):
                kept.append(took)
    found = []
    for k, n in enumerate(_LENGTHS):
        (split_f, split_b), (plain_f, plain_b) = (_medians(times[2 * k + j]) for j in (0, 1))
        found.append(ChainTimes(n, split_f, split_b, plain_f, plain_b))
    return found


def _medians(passes: list[tuple[float, float]]) -> tuple[float, float]:
    return (statistics.median(f for f, _ in passes), statistics.median(b for _, b in passes))


def _chain(layers: int, device: torch.device) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(_WIDTH, _WIDTH), nn.ReLU())
                           for _ in range(layers)]).to(device)


def _one_pass(module: nn.Module, x: torch.Tensor, timer: Timer, group: Any
              ) -> tuple[float, float]:
    """Seconds of ``module``'s forward and of its backward, the members of ``group``
    starting together."""
    out: list[torch.Tensor] = []

    def forward() -> None:
        out.append(module(x))

    def backward() -> None:
        out.pop().sum().backward()  # type: ignore[no-untyped-call]

    dist.barrier(group=group)
    took = timer(forward), timer(backward)
    module.zero_grad(set_to_none=True)
    return took

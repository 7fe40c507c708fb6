"""What the runtime's own forward and backward cost beyond the layers the profile times.

A stage runs its layers through :class:`~dreampipe.runtime.stage_module.StageModule`
(weight versions put in the parameters' places, fused ``nn.Linear`` gradients,
hooks), at a cost that depends on the model and the host. This module runs the
whole model both ways, plain and through the runtime, interleaved so that the
host's drift hits both alike, and keeps the medians' ratios in the graph's
meta (``runtime_forward``, ``runtime_backward``), which
:func:`~dreampipe.machine.calibration.local_costs` multiplies each stage's
layer times by. It also times the loss, which the profile leaves out and the
last stage pays (``loss_forward_ms``, ``loss_backward_ms``; docs/design.md §9.1).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from dreampipe.models.spec import ModelSpec
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runtime.stage_module import StageModule

__all__ = ["with_runtime_overhead"]

_Round = Callable[[], tuple[float, float]]


def with_runtime_overhead(graph: LayerGraph, spec: ModelSpec, *, rounds: int = 3,
                          min_time_s: float = 0.25) -> LayerGraph:
    """``graph`` with the runtime's forward and backward over plain PyTorch's in its meta.

    One untimed round of each, then at least ``rounds`` timed ones, and as many
    more as fill ``min_time_s`` (a small model's rounds take milliseconds, a
    large one's a second: its few rounds already span the drift).
    """
    batch = graph.batch_size or spec.default_batch_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        x, y = spec.sample_input(batch), spec.sample_target(batch)
    model = spec.build(seed=0)
    ways = (_plain(model, spec, x, y), _runtime(spec, x, y))
    took: tuple[list[tuple[float, float]], ...] = ([], [])
    start = time.perf_counter()
    k = 0
    while k <= rounds or time.perf_counter() - start < min_time_s:  # round 0 is not timed
        for way, times in zip(ways, took, strict=True):
            got = way()
            if k > 0:
                times.append(got)
        k += 1
    plain, runtime = ([statistics.median(t[i] for t in times) for i in (0, 1)] for times in took)
    factors = [r / p if p > 0 else 1.0 for r, p in zip(runtime, plain, strict=True)]
    loss = _loss_ms(model, spec, x, y, max(rounds, len(took[0])))
    return replace(graph, meta={**graph.meta, "runtime_forward": round(factors[0], 4),
                                "runtime_backward": round(factors[1], 4),
                                "loss_forward_ms": round(loss[0], 4),
                                "loss_backward_ms": round(loss[1], 4)})


def _loss_ms(model: torch.nn.Module, spec: ModelSpec, x: torch.Tensor, y: torch.Tensor,
             rounds: int) -> tuple[float, float]:
    """Median milliseconds of the loss on ``model``'s output, forward and backward."""
    with torch.no_grad():
        out = model(x)
    took: list[tuple[float, float]] = []
    for _ in range(rounds):
        leaf = out.detach().requires_grad_(True)
        t0 = time.perf_counter()
        loss = spec.loss_fn(leaf, y)
        t1 = time.perf_counter()
        torch.autograd.backward(loss)
        took.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
    return statistics.median(t[0] for t in took), statistics.median(t[1] for t in took)


def _plain(model: torch.nn.Module, spec: ModelSpec, x: torch.Tensor, y: torch.Tensor
           ) -> _Round:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)

    def run() -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = spec.loss_fn(model(x), y)
        t1 = time.perf_counter()
        torch.autograd.backward(loss)
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1

    return run


def _runtime(spec: ModelSpec, x: torch.Tensor, y: torch.Tensor) -> _Round:
    stage = StageModule(spec.build(seed=0), lambda p: torch.optim.SGD(p, lr=1e-6), stage=0,
                        input_grad=False, loss_fn=spec.loss_fn)
    microbatch = [0]

    def run() -> tuple[float, float]:
        t0 = time.perf_counter()
        stage.forward(microbatch[0], x, target=y)
        t1 = time.perf_counter()
        stage.backward(microbatch[0])
        t2 = time.perf_counter()
        stage.step()
        microbatch[0] += 1
        return t1 - t0, t2 - t1

    return run

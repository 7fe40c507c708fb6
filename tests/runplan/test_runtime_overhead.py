"""The runtime's forward and backward beside plain PyTorch
(:mod:`~dreampipe.runplan.runtime_overhead`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
from torch import Tensor

from dreampipe.models import get_model
from dreampipe.profiling.profiler import profile_spec
from dreampipe.runplan.runtime_overhead import with_runtime_overhead
from dreampipe.runplan.worker_profile import profile_as_worker


@pytest.mark.timing  # measured seconds: alone on the cores (make test)
def test_the_profile_carries_the_runtimes_forward_and_backward_over_plain_pytorch() -> None:
    spec = get_model("mlp", layers=3, width=64)
    profile = profile_spec(spec, batch_size=8, repeats=2)
    # rounds of microseconds: enough of them that a median survives a busy machine
    graph = with_runtime_overhead(profile, spec, rounds=15, min_time_s=0.2)
    assert graph.layers == profile.layers  # the layers stay as measured
    for key in ("runtime_forward", "runtime_backward"):
        factor = graph.meta[key]
        # same layers and same kernels: the runtime's bookkeeping costs, it does not halve them
        assert math.isfinite(factor) and 0.5 < factor < 5.0, (key, factor)
    assert graph.meta["loss_forward_ms"] > 0 and graph.meta["loss_backward_ms"] > 0


def test_the_loss_is_timed_on_the_models_output() -> None:
    spec = get_model("mlp", layers=2, width=16)
    slow = replace(spec, loss_fn=_sleepy(spec.loss_fn, 0.004))
    graph = with_runtime_overhead(profile_spec(spec, batch_size=4, repeats=1), slow,
                                  rounds=3, min_time_s=0.0)
    assert graph.meta["loss_forward_ms"] >= 4.0  # the sleep is inside the loss's forward
    assert graph.meta["loss_backward_ms"] < 4.0


def _sleepy(loss_fn: Callable[[Tensor, Tensor], Tensor], seconds: float
            ) -> Callable[[Tensor, Tensor], Tensor]:
    def slow(out: Tensor, target: Tensor) -> Tensor:
        time.sleep(seconds)
        return loss_fn(out, target)

    return slow


def test_a_worker_profile_is_taken_with_the_runtime_overhead() -> None:
    graph = profile_as_worker(get_model("mlp", layers=2, width=32), 4, repeats=1)
    assert {"runtime_forward", "runtime_backward"} <= set(graph.meta)

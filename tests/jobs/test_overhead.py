"""The runtime's own forward and backward against plain PyTorch (:mod:`dreampipe.jobs.overhead`)."""

from __future__ import annotations

import math

from dreampipe.jobs.local import profile_as_worker
from dreampipe.jobs.overhead import with_runtime_overhead
from dreampipe.models import get_model
from dreampipe.profiling.profiler import profile_spec


def test_the_profile_carries_the_runtimes_forward_and_backward_over_plain_pytorch() -> None:
    spec = get_model("mlp", layers=3, width=64)
    profile = profile_spec(spec, batch_size=8, repeats=2)
    graph = with_runtime_overhead(profile, spec, rounds=3, min_time_s=0.0)
    assert graph.layers == profile.layers  # the layers stay as measured
    for key in ("runtime_forward", "runtime_backward"):
        factor = graph.meta[key]
        # same layers and same kernels: the runtime's bookkeeping costs, it does not halve them
        assert math.isfinite(factor) and 0.5 < factor < 5.0, (key, factor)


def test_a_worker_profile_is_taken_with_the_runtime_overhead() -> None:
    graph = profile_as_worker(get_model("mlp", layers=2, width=32), 4, repeats=1)
    assert {"runtime_forward", "runtime_backward"} <= set(graph.meta)

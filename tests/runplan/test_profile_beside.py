"""A profile taken beside busy twins, and the pace a crowd beyond the cores sets
(:func:`~dreampipe.runplan.profile_beside.profile_beside`)."""

from __future__ import annotations

import os
import time

import pytest

from dreampipe.errors import ConfigError
from dreampipe.runplan.profile_beside import profile_beside

__all__: list[str] = []


def test_a_profile_beside_a_twin_times_every_layer_and_says_so() -> None:
    graph = profile_beside("mlp", 8, 1, model_kwargs=(("width", 64),), repeats=2,
                           deadline_s=60.0)
    assert graph.meta["twins"] == 1
    assert "share" not in graph.meta  # no more processes than profile
    assert graph.meta["allreduce_bandwidth"] > 0 and graph.meta["step_bandwidth"] > 0
    totals = graph.meta["profiles_ms"]
    assert len(totals) == 2  # both processes profiled; the slower one is kept
    assert graph.total_ms() == pytest.approx(max(totals), abs=1e-3)
    assert graph.batch_size == 8
    assert [layer.name for layer in graph.layers] == [f"fc{i}" for i in range(len(graph.layers))]
    assert all(layer.forward_ms > 0 and layer.backward_ms > 0 for layer in graph.layers)


@pytest.mark.timing  # measured seconds: alone on the cores (make test)
def test_a_crowd_beyond_the_cores_waits_then_measures_how_they_are_shared() -> None:
    graph = profile_beside("mlp", 8, 1, crowd=1, model_kwargs=(("width", 64),), repeats=2,
                           deadline_s=60.0)
    assert len(graph.meta["profiles_ms"]) == 2  # the crowd does not profile
    assert graph.meta["shared_by"] == 3
    assert graph.meta["share_cores"] == len(os.sched_getaffinity(0))
    assert 0.5 < graph.meta["share"] < 10.0  # one thread each: 3 on 2 cores is about 1.5
    assert graph.meta["allreduce_bandwidth"] > 0  # measured among the 2 that profiled
    with pytest.raises(ConfigError, match="crowd=-1"):
        profile_beside("mlp", 8, 1, crowd=-1)


@pytest.mark.timing  # measured seconds: alone on the cores (make test)
def test_a_pace_counts_the_passes_that_end_by_the_deadline() -> None:
    from dreampipe.runplan.profile_beside import _mean_pass_s

    calls: list[float] = []

    def pass_of_20_ms() -> None:
        calls.append(time.time())
        time.sleep(0.02)

    mean = _mean_pass_s(pass_of_20_ms, time.time() + 0.2)
    assert mean == pytest.approx(0.02, rel=0.5)
    assert time.time() - calls[-1] < 0.1 and len(calls) >= 5  # it trained past the deadline
    # one pass longer than the whole phase: that pass
    assert _mean_pass_s(lambda: time.sleep(0.05), time.time() + 0.01) >= 0.05


def test_a_profile_beside_no_twin_is_a_plain_profile_in_a_worker() -> None:
    graph = profile_beside("mlp", 8, 0, model_kwargs=(("width", 64),), repeats=1,
                           deadline_s=60.0)
    assert graph.meta["twins"] == 0
    with pytest.raises(ConfigError, match="twins=-1"):
        profile_beside("mlp", 8, -1)

"""Compute alone and beside busy twins (:func:`measure_corun`, :func:`profile_beside`)."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from dreampipe.errors import ConfigError
from dreampipe.machine.calibration import corun_twins
from dreampipe.machine.corun import Corun, measure_corun, profile_beside
from machine.fixtures import DEV_MACHINE

__all__: list[str] = []


def test_rank_0_times_each_round_alone_then_beside_its_twin() -> None:
    corun = measure_corun("mlp", 8, model_kwargs=(("width", 64),), repeats=2, deadline_s=60.0)
    assert len(corun.alone_s) == len(corun.beside_s) == 2
    assert all(0.0 < t < 5.0 for t in corun.alone_s + corun.beside_s)
    # the median of two rounds is their mean
    assert corun.ratio == pytest.approx(sum(corun.beside_s) / sum(corun.alone_s))
    assert corun.slowdown == max(1.0, corun.ratio)


def test_slowdown_is_the_ratio_of_medians_and_described() -> None:
    corun = Corun(alone_s=(0.1, 0.3, 0.2), beside_s=(0.25, 0.2, 0.9))
    assert corun.slowdown == pytest.approx(1.25)
    assert corun.describe() == ("forward+backward alone 200 ms (100-300), beside a busy "
                                "worker 250 ms (200-900): x1.250")


def test_a_ratio_below_one_is_no_slowdown_and_says_the_host_moved() -> None:
    corun = Corun(alone_s=(0.4, 0.4, 0.4), beside_s=(0.2, 0.2, 0.2))
    assert corun.ratio == pytest.approx(0.5)
    assert corun.slowdown == 1.0
    assert corun.describe().endswith(
        "x1.000 (measured x0.500: the host was busier while timing alone; "
        "calibrate again on a quiet machine)")


@pytest.mark.parametrize(("batch", "repeats", "what"), [(8, 0, "repeats"), (0, 1, "batch_size")])
def test_bad_arguments_are_refused_before_any_process(batch: int, repeats: int, what: str) -> None:
    with pytest.raises(ConfigError, match=f"{what}=0"):
        measure_corun("mlp", batch, repeats=repeats)


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


def test_a_pace_counts_the_passes_that_end_by_the_deadline() -> None:
    from dreampipe.machine.corun import _mean_pass_s

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


def test_each_local_worker_computes_beside_the_others_up_to_the_cores() -> None:
    machine = dataclasses.replace(DEV_MACHINE, cores=2)
    assert [corun_twins(w, machine) for w in (1, 2, 3, 8)] == [0, 1, 1, 1]
    assert corun_twins(3, dataclasses.replace(DEV_MACHINE, cores=4)) == 2

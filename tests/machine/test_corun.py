"""Compute alone and beside busy twins (:func:`measure_corun`)."""

from __future__ import annotations

import dataclasses

import pytest

from dreampipe.errors import ConfigError
from dreampipe.machine.calibration import corun_twins
from dreampipe.machine.corun import Corun, measure_corun
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


def test_each_local_worker_computes_beside_the_others_up_to_the_cores() -> None:
    machine = dataclasses.replace(DEV_MACHINE, cores=2)
    assert [corun_twins(w, machine) for w in (1, 2, 3, 8)] == [0, 1, 1, 1]
    assert corun_twins(3, dataclasses.replace(DEV_MACHINE, cores=4)) == 2

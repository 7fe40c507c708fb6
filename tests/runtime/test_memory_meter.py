"""``runtime/memory_meter.py``: a rank's peak tensor bytes, counted on CPU and read from
CUDA's allocator (its statistics stood in for: each rank measures its own device, from a
reset peak, after the device's queued work has run)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dreampipe.runtime import memory_meter

__all__: list[str] = []


def test_a_cpu_meter_counts_the_weights_given_and_what_the_rank_computes() -> None:
    weights = torch.ones(1000)  # 4000 bytes, made before
    meter = memory_meter.start_measuring(torch.device("cpu"))
    assert memory_meter.current_meter() is meter
    meter.adopt([weights, weights[:10]])
    outside = torch.ones(5000)  # not computed while counting: not the rank's
    with meter.counting():
        with meter.counting():  # re-entrant: counted once
            a = weights * 2
        b = torch.zeros(2000)
        del a
    del weights  # freed while measuring: no longer counted
    use = meter.finish(rank=2, stage=1)
    assert (use.kind, use.baseline, use.peak) == ("cpu", 0, 4000 + 4000 + 8000)
    assert memory_meter.current_meter() is None  # the next Pipeline measures afresh
    with meter.counting():  # after finish: nothing more counts
        c = torch.ones(10**6)
    assert meter.finish(rank=2, stage=1) is use
    del b, c, outside


class _Allocator:
    """Per-device allocated bytes and peak, as ``torch.cuda`` keeps them."""

    def __init__(self) -> None:
        self.allocated = {0: 100, 1: 300}
        self.peak = {0: 5000, 1: 7000}
        self.calls: list[tuple[str, Any]] = []

    def synchronize(self, device: torch.device) -> None:
        self.calls.append(("synchronize", device))

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self.calls.append(("reset", device))
        self.peak[device.index] = self.allocated[device.index]

    def memory_allocated(self, device: torch.device) -> int:
        return self.allocated[device.index]

    def max_memory_allocated(self, device: torch.device) -> int:
        self.calls.append(("peak", device))
        return self.peak[device.index]


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> _Allocator:
    fake = _Allocator()
    for name in ("synchronize", "reset_peak_memory_stats", "memory_allocated",
                 "max_memory_allocated"):
        monkeypatch.setattr(memory_meter.torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(memory_meter.torch.cuda, "is_available", lambda: True)
    return fake


def test_a_rank_measures_the_cuda_device_of_its_local_rank(
        allocator: _Allocator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    gpu1 = torch.device("cuda", 1)
    meter = memory_meter.start_measuring()
    assert meter.device == gpu1 and memory_meter.current_meter() is meter
    assert allocator.calls == [("synchronize", gpu1), ("reset", gpu1)]
    meter.adopt([torch.ones(25)])  # 100 bytes made before: already in the allocator's 300
    allocator.allocated[1] = 900
    allocator.peak[1] = 2300
    allocator.peak[0] = 10**9  # another rank's device: not this rank's peak
    use = meter.finish(rank=1, stage=1)
    assert allocator.calls[-2:] == [("synchronize", gpu1), ("peak", gpu1)]
    assert (use.kind, use.baseline, use.peak, use.used) == ("cuda", 200, 2300, 2100)
    assert meter.finish(rank=1, stage=1) is use  # measuring stopped



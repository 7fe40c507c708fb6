"""``runtime/memory.py`` on CUDA, with the allocator's statistics stood in for: each rank
measures its own device, from a reset peak, after the device's queued work has run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dreampipe.runtime import memory

__all__: list[str] = []


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
        monkeypatch.setattr(memory.torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: True)
    return fake


def test_a_rank_measures_the_cuda_device_of_its_local_rank(
        allocator: _Allocator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    gpu1 = torch.device("cuda", 1)
    base = memory.start_measuring()
    assert base.device == gpu1 and base.resident == 300 and base.code == 0
    assert allocator.calls == [("synchronize", gpu1), ("reset", gpu1)]
    allocator.allocated[1] = 900
    allocator.peak[1] = 2300
    allocator.peak[0] = 10**9  # another rank's device: not this rank's peak
    use = memory.finish_measuring(base, rank=1, stage=1)
    assert allocator.calls[-2:] == [("synchronize", gpu1), ("peak", gpu1)]
    assert (use.kind, use.baseline, use.peak, use.used) == ("cuda", 300, 2300, 2000)

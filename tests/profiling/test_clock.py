"""``profiling/clock.py``: which clock times a device, and when a CUDA reading synchronizes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from dreampipe.profiling import clock as clock_module
from dreampipe.profiling import profiler
from dreampipe.profiling.clock import CudaClock, HostClock, clock_for

__all__: list[str] = []


def test_the_cpu_is_timed_by_the_host_and_a_gpu_by_its_own_device() -> None:
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    gpu = clock_for(torch.device("cuda", 1))
    assert isinstance(gpu, CudaClock) and gpu.device == torch.device("cuda", 1)


def test_the_host_clock_times_the_span_when_it_stops() -> None:
    clock = HostClock()
    before = time.perf_counter()
    mark = clock.start()
    time.sleep(0.02)
    reading = clock.stop(mark)
    stopped_ms = (time.perf_counter() - before) * 1e3
    time.sleep(0.05)
    # the span ends at stop(), not when the reading is read 50 ms later
    assert 20.0 <= reading() <= stopped_ms


class _Event:
    """Stands in for ``torch.cuda.Event``: a time stamp that is ready only once synchronized."""

    log: ClassVar[list[str]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None
        self.synced = False

    def record(self, stream: Any) -> None:
        assert stream == ("stream of", torch.device("cuda", 1))
        self.at = time.perf_counter()
        self.log.append("record")

    def synchronize(self) -> None:
        self.synced = True
        self.log.append("synchronize")

    def elapsed_time(self, end: _Event) -> float:
        assert end.synced, "read before the end event ran"
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    _Event.log = []
    monkeypatch.setattr(clock_module.torch.cuda, "Event", _Event)
    monkeypatch.setattr(clock_module.torch.cuda, "current_stream",
                        lambda device: ("stream of", device))
    return _Event.log


def test_a_cuda_reading_records_on_the_device_stream_and_syncs_only_when_read(
        fake_cuda: list[str]) -> None:
    clock = CudaClock(torch.device("cuda", 1))
    mark = clock.start()
    time.sleep(0.01)
    reading = clock.stop(mark)
    assert fake_cuda == ["record", "record"]
    assert reading() >= 10.0
    assert fake_cuda == ["record", "record", "synchronize"]


def test_the_profiler_reads_each_pass_once_it_is_queued(
        fake_cuda: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiler, "clock_for", lambda device: CudaClock(torch.device("cuda", 1)))
    forked: list[list[int]] = []

    @contextlib.contextmanager
    def fork_rng(devices: list[int]) -> Iterator[None]:
        forked.append(devices)  # the CUDA device whose RNG the profiler must restore
        yield

    monkeypatch.setattr(profiler.torch.random, "fork_rng", fork_rng)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    graph = profiler.profile_model(model, torch.randn(3, 4), torch.nn.functional.cross_entropy,
                                   torch.tensor([0, 1, 0]), warmup=1, repeats=2)
    assert len(graph.layers) == 3
    # per pass: 3 forwards, then the backward's timed calls: the last Linear's whole
    # backward and its weights alone, the ReLU's and the first Linear's backward (its input
    # needs no gradient), 7 spans of two records each; then every reading is read: the
    # first Linear's one span twice (its backward is its weight gradient), 8 synchronizes
    per_pass = ["record"] * 14 + ["synchronize"] * 8
    assert fake_cuda == per_pass * 3
    assert forked == [[1]]

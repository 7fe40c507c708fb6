"""How a measurement times its work: the host's clock, or CUDA events on the GPU.

A collective or a step on the CPU is done when its call returns, so the
wall clock times it. On a GPU the call only queues kernels: the work is
timed between two CUDA events recorded on the current stream around it,
after the stream has drained, so that every measurement of
:mod:`~dreampipe.machine.rates` and :mod:`~dreampipe.machine.measure` is
the same code on both and differs only in its :class:`Timer`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["CudaTimer", "Timer", "WallTimer", "timer_for"]


class Timer(Protocol):
    """Seconds ``work()`` takes to complete."""

    def __call__(self, work: Callable[[], Any]) -> float: ...


class WallTimer:
    """The host's monotonic clock around the call: for work done when it returns."""

    def __call__(self, work: Callable[[], Any]) -> float:
        start = time.perf_counter()
        work()
        return time.perf_counter() - start


class CudaTimer:
    """CUDA events around the work queued on the current stream, the stream drained
    first (so the start event times this work alone) and after."""

    def __call__(self, work: Callable[[], Any]) -> float:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        work()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3


def timer_for(device: torch.device) -> Timer:
    """The timer for work on ``device``."""
    return CudaTimer() if device.type == "cuda" else WallTimer()

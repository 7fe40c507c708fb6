"""Timing a span of work on one device: host time on the CPU, CUDA events on a GPU.

On the CPU a layer's work is done when its call returns, so the host's clock
times it. On a GPU the call only queues kernels: the host's clock would time
the launches, and a ``synchronize`` around every layer would drain the queue
the kernels overlap in while training. So a :class:`CudaClock` records an
event on the device's current stream before and after the span (the stream
the layer's kernels and, through autograd's stream semantics, its backward's
run on) and reads the time between them only when asked, after the events
have run (``Event.synchronize``): once per pass, not per layer.

A reading is a callable giving milliseconds: read every reading of a pass
once the pass is queued.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["Clock", "CudaClock", "HostClock", "Reading", "clock_for"]

Reading = Callable[[], float]


class Clock(Protocol):
    """Starts and stops spans; :meth:`stop` gives a reading of the span in milliseconds."""

    def start(self) -> Any: ...

    def stop(self, mark: Any) -> Reading: ...


class HostClock:
    """Wall time (``perf_counter``) of work that is done when its call returns."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, mark: float) -> Reading:
        ms = (time.perf_counter() - mark) * 1e3
        return lambda: ms


class CudaClock:
    """The GPU's time between two events on ``device``'s current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> Any:
        return self._event()

    def stop(self, mark: Any) -> Reading:
        end = self._event()

        def read() -> float:
            end.synchronize()
            return float(mark.elapsed_time(end))

        return read


def clock_for(device: torch.device) -> Clock:
    """The clock that times work on ``device``: CUDA events on a GPU, else host time."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return CudaClock(torch.device("cuda", index))
    return HostClock()

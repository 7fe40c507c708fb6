"""A rank's peak memory during training: the bytes its tensors hold at most, above what
they held when measuring started.

On GPU that is CUDA's allocator's figure (``max_memory_allocated``); on CPU a
:class:`~dreampipe.profiling.tensor_bytes.TensorBytes` counts the tensors' storages
the same way while the rank computes (:meth:`Meter.counting`). Either way the figure
is the tensors': the weights, stashed versions, gradients, optimizer state and
activations that :func:`~dreampipe.runtime.memory.predict_memory` predicts, and not
the heap around them or a compute library's kernel caches, which a process's resident
size adds and differs by allocator and machine (docs/design.md §5.4). Weights that
existed before measuring started are counted once given (:meth:`Meter.adopt`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dreampipe.profiling.tensor_bytes import TensorBytes

__all__ = ["MemoryUse", "Meter", "current_meter", "start_measuring"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryUse:
    """One rank's memory in bytes: what its tensors held when measuring started
    (``baseline``) and at most since (``peak``).

    ``kind`` is the device type: ``"cpu"`` or ``"cuda"``.
    """

    rank: int
    stage: int
    baseline: int
    peak: int
    kind: str

    @property
    def used(self) -> int:
        """What training added: ``peak - baseline``."""
        return self.peak - self.baseline


class Meter:
    """One rank's measurement, from :func:`start_measuring` to :meth:`finish`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tensors = TensorBytes(device.type) if device.type != "cuda" else None
        self._adopted = 0  # CUDA: weights given, already in the allocator's baseline
        self._depth = 0
        self._use: MemoryUse | None = None
        if self._tensors is None:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._start = int(torch.cuda.memory_allocated(device))
        else:
            self._start = 0

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors``, made before measuring started (each storage once)."""
        if self._tensors is not None:
            self._tensors.adopt(tensors)
            return
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t.device.type != "meta"}
        self._adopted += sum(seen.values())

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count what the rank computes inside (on CPU; re-entrant; CUDA counts anyway)."""
        if self._tensors is None or self._depth or self._use is not None:
            yield
            return
        self._depth += 1
        try:
            with self._tensors.counting():
                yield
        finally:
            self._depth -= 1

    def finish(self, rank: int, stage: int) -> MemoryUse:
        """The peak so far; measuring stops (a second call returns the same)."""
        if self._use is not None:
            return self._use
        if self._tensors is None:
            torch.cuda.synchronize(self.device)
            peak = int(torch.cuda.max_memory_allocated(self.device))
            self._use = MemoryUse(rank, stage, self._start - self._adopted, peak, "cuda")
        else:
            self._use = MemoryUse(rank, stage, 0, self._tensors.peak, self.device.type)
            self._tensors.close()
        if self in _CURRENT:
            _CURRENT.remove(self)
        return self._use


_CURRENT: list[Meter] = []  # the meter this process measures with, once started


def current_meter() -> Meter | None:
    """The meter :func:`start_measuring` started last in this process, until it
    finishes (None: none)."""
    return _CURRENT[-1] if _CURRENT else None


def start_measuring(device: torch.device | None = None) -> Meter:
    """Start measuring this process's tensors on ``device``: None is this rank's, CUDA
    device ``LOCAL_RANK`` if there is CUDA, else the CPU."""
    if device is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) \
            if torch.cuda.is_available() else torch.device("cpu")
    meter = Meter(device)
    _CURRENT[:] = [meter]
    _log.debug("measuring the tensors' peak bytes on %s", device)
    return meter

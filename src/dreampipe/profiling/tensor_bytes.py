"""The bytes a process's tensors hold on the CPU, and their peak: CUDA's
``max_memory_allocated`` for the CPU.

A :class:`TensorBytes` counts every tensor storage an operation makes while it
counts (a ``TorchDispatchMode`` sees each operation's outputs; one that is an
input's, as in-place operations return, is not new), plus storages it is given
(:meth:`TensorBytes.adopt`: weights that existed before), until
each is freed (a weak reference to the storage fires) or resized
(``UntypedStorage.resize_``, which no dispatch mode sees, is wrapped while a
tracker lives). Views share their base's storage and are counted once. The
figure is what the tensors hold, not what the heap around them keeps: the same
quantity on CPU as on GPU, and the one :func:`~dreampipe.runtime.memory.predict_memory`
predicts. torch's ``MemTracker`` counts the same way, per module (docs/design.md §5.4).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TensorBytes"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)

_RESIZE = torch.UntypedStorage.resize_
_LIVE: list[TensorBytes] = []  # the trackers whose resizes the wrapped resize_ reports


def _resize(storage: torch.UntypedStorage, size: int) -> Any:
    out = _RESIZE(storage, size)
    for tracker in _LIVE:
        tracker._resized(storage)
    return out


class TensorBytes:
    """Live tensor bytes on ``device_type`` (``now``) and their most (``peak``) since made.

    Counting happens inside :meth:`counting` (operations run outside it make storages
    that are not counted); frees and resizes of counted storages are seen at any time
    until :meth:`close`.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self.now = 0
        self.peak = 0
        self._sizes: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        if not _LIVE:
            torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign, assignment]
        _LIVE.append(self)

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of ``tensors`` (each once; ``meta`` ones hold nothing)."""
        for t in tensors:
            self._count(t)

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count the storages the operations run inside make."""
        with _Watch(self):
            yield

    def reset_peak(self) -> None:
        """Make the peak what is live now."""
        self.peak = self.now

    def close(self) -> None:
        """Stop seeing frees and resizes (the figures stay as they are)."""
        if self in _LIVE:
            _LIVE.remove(self)
            if not _LIVE:
                torch.UntypedStorage.resize_ = _RESIZE  # type: ignore[method-assign]
        self._sizes.clear()

    def _count(self, t: torch.Tensor, inputs: frozenset[int] = frozenset()) -> None:
        if t.device.type != self.device_type or type(t) not in _PLAIN:
            return  # subclasses (DTensor) hold their local tensors, which are counted
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._sizes:
            self._resized(storage)
            return
        if key in inputs:
            return  # an input's, made before counting: not this tracker's
        self._sizes[key] = (weakref.ref(storage, functools.partial(self._freed, key)),
                            storage.nbytes())
        self._add(storage.nbytes())

    def _resized(self, storage: torch.UntypedStorage) -> None:
        held = self._sizes.get(id(storage))
        if held is not None and held[1] != storage.nbytes():
            self._sizes[id(storage)] = (held[0], storage.nbytes())
            self._add(storage.nbytes() - held[1])

    def _freed(self, key: int, _ref: object = None) -> None:
        held = self._sizes.pop(key, None)
        if held is not None:
            self.now -= held[1]

    def _add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


def _has_dtensor(types: Any) -> bool:
    """Whether a DTensor is among an operation's tensor types (none exists before
    ``torch.distributed.tensor`` is imported)."""
    loaded = sys.modules.get("torch.distributed.tensor")
    return loaded is not None and any(issubclass(t, loaded.DTensor) for t in types)


class _Watch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Hands every tensor an operation returns to its tracker."""

    def __init__(self, tracker: TensorBytes) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._tracker = tracker

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if _has_dtensor(types):
            return NotImplemented  # DTensor runs its local operations, counted, first
        kwargs = kwargs or {}
        inputs = frozenset(id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                           if isinstance(t, torch.Tensor) and t.device.type != "meta")
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._tracker._count(t, inputs)
        return out

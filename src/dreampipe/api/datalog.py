"""A data log: which minibatches a run trained, one JSON line each, so restarts can be audited.

A run (and every restart of it) appends to the same file::

    {"event": "start", "attempt": 1, "from": 20, "steps": 60, "plan": "2-1", "workers": 3}
    {"event": "minibatch", "attempt": 1, "minibatch": 20, "sha256": "9f1c..."}

``attempt`` is torchrun's restart count (0 when not under torchrun);
``from`` is the minibatch the attempt resumed at, so minibatches an
attempt trained at or past the next attempt's ``from`` were rolled back and
trained again. The hash is over the minibatch's input and target bytes.
Each line is written when the pipeline has been given that minibatch, and
reaches the file at once (a killed process loses no line it wrote).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import IO, Any

from torch import Tensor

__all__ = ["DataLog", "attempt"]


def attempt() -> int:
    """This process's torchrun restart count (0 when not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _digest(tensors: tuple[Tensor, ...]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class DataLog:
    """Appends a run's start and every minibatch it trains to ``path`` (see the module)."""

    def __init__(self, path: Path, *, start: int, steps: int, plan: str, workers: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._attempt = attempt()
        self._file: IO[str] = path.open("a", buffering=1)  # line-buffered: one write per line
        self._write({"event": "start", "attempt": self._attempt, "from": start, "steps": steps,
                     "plan": plan, "workers": workers})

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def record(self, minibatch: int, x: Tensor | tuple[Tensor, ...], y: Tensor) -> None:
        """Minibatch ``minibatch`` (its input ``x`` and target ``y``) was trained."""
        xs = x if isinstance(x, tuple) else (x,)
        self._write({"event": "minibatch", "attempt": self._attempt, "minibatch": minibatch,
                     "sha256": _digest((*xs, y))})

    def close(self) -> None:
        self._file.close()


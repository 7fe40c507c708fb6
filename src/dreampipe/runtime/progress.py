"""The progress bar of a run: one tqdm bar on stderr, kept by one rank.

Only the last stage's first replica shows it (it alone knows each unit's
loss); it counts backwards, so it fills as units finish, and shows the
latest loss and the samples per second so far.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from torch import Tensor

from dreampipe.scheduling.actions import Action, ActionKind

__all__ = ["ProgressBar"]


class ProgressBar:
    """A bar over the ``BACKWARD`` actions of ``actions``, ``unit_size`` samples each."""

    def __init__(self, actions: tuple[Action, ...], unit_size: int, *, pipedream: bool) -> None:
        from tqdm import tqdm

        # tqdm's default lock is a multiprocessing semaphore, which the rank would leave
        # behind ("leaked semaphore objects" at exit); one bar per process needs a thread lock
        tqdm.set_lock(threading.RLock())
        total = sum(1 for a in actions if a.kind is ActionKind.BACKWARD)
        self._bar: Any = tqdm(total=total, unit="minibatch" if pipedream else "microbatch",
                              file=sys.stderr, dynamic_ncols=True)
        self._unit_size = unit_size
        self._start = time.perf_counter()

    def update(self, loss: Tensor) -> None:
        """One more unit done, whose loss is ``loss``."""
        self._bar.update(1)
        elapsed = time.perf_counter() - self._start
        rate = self._bar.n * self._unit_size / elapsed if elapsed > 0 else 0.0
        self._bar.set_postfix(loss=f"{float(loss):.4f}", samples_per_s=f"{rate:.0f}",
                              refresh=False)

    def close(self) -> None:
        self._bar.close()

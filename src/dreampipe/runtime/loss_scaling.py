"""fp16's dynamic loss scale, one for all stages (``precision="fp16-mixed"``).

The last stage multiplies each microbatch's loss by the scale ``S`` before its
backward, so that small gradients stay above fp16's smallest values; every stage's
gradients then carry ``S``. At each update every rank divides its gradients by ``S``
and checks them for inf and NaN; the ranks agree (one all-reduce, with the check of
:mod:`.nonfinite`), and if any stage overflowed, every stage skips the update and ``S``
halves. After ``window`` updates in a row without an overflow ``S`` doubles. That is
``torch.amp.GradScaler``'s rule, with the same kernels, so one process with a
GradScaler of the same settings takes the same steps. docs/design.md §5.5.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["LossScale"]


class LossScale:
    """The loss scale of a run: starts at ``initial``, halves after an overflow, doubles
    after ``window`` updates without one (identical on every rank)."""

    def __init__(self, initial: float, window: int) -> None:
        self._scale = torch.tensor(float(initial), dtype=torch.float32)
        self._window = window
        self._good = 0

    @property
    def value(self) -> float:
        """The scale the next microbatches' losses are multiplied by."""
        return float(self._scale)

    def unscale(self, grads: Sequence[Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; whether all of them are finite."""
        found = torch.zeros(1, dtype=torch.float32)
        inv = self._scale.double().reciprocal().float()
        by_device: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for g in grads:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_device.items():
            here = found.to(device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, here, inv.to(device))
            found += here.cpu()
        return float(found) == 0.0

    def update(self, overflowed: bool) -> None:
        """After an update: lower the scale if any stage ``overflowed``, else count it."""
        if overflowed:
            self._scale *= 0.5
            self._good = 0
            return
        self._good += 1
        if self._good >= self._window:  # a resume with a shorter window may start past it
            self._scale *= 2.0
            self._good = 0

    def state_dict(self) -> dict[str, float | int]:
        """The scale and the updates counted since it last changed (checkpoints)."""
        return {"scale": self.value, "good": self._good}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Continue from :meth:`state_dict`."""
        self._scale.fill_(float(state["scale"]))
        self._good = int(state["good"])

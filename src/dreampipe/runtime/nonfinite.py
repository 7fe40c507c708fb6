"""NaN and inf in training: stop at the first one, or skip the minibatch that made it.

Every forward of a training microbatch checks what it hands on (the stage's output,
or on the last stage the loss) by its sum: a finite sum means finite values,
and only a sum that is not finite is checked value by value, so the check is
one reduction and no mask. :class:`OnNonFinite` says what happens then:
``STOP`` raises :class:`~dreampipe.errors.NonFiniteError` on the rank that saw
it, naming the minibatch, the stage and whether its input was already bad;
``SKIP`` (synchronous schedules) lets the minibatch run to its ``STEP``, where
every rank agrees whether any stage saw one, and if so every stage drops the
update. The rules, and why PipeDream's schedule takes ``STOP`` only:
docs/design.md §8.4;
:class:`~dreampipe.api.config.TrainConfig` refuses ``SKIP`` with PipeDream.
"""

from __future__ import annotations

import logging
import math
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dreampipe.errors import NonFiniteError
from dreampipe.scheduling.actions import Action, Schedule, ScheduleKind

__all__ = ["NonFiniteGuard", "OnNonFinite"]

_log = logging.getLogger(__name__)


class OnNonFinite(Enum):
    """What a run does when a forward output or a loss holds NaN or inf."""

    STOP = "stop"
    SKIP = "skip"


def _what(t: Tensor) -> str:
    """``"3 of 80 values are nan"`` (or inf, or nan and inf)."""
    nan = int(torch.isnan(t).sum())
    bad = int((~torch.isfinite(t)).sum())
    kinds = "nan" if nan == bad else "inf" if nan == 0 else "nan or inf"
    return f"{bad} of {t.numel()} values are {kinds}"


def _all_finite(t: Tensor) -> bool:
    """Whether every value of ``t`` is finite; see the module docstring."""
    with torch.no_grad():
        return math.isfinite(float(t.detach().sum())) or bool(torch.isfinite(t).all())


def _finite(x: Tensor | tuple[Tensor, ...] | dict[str, Tensor]) -> bool:
    parts = tuple(x.values()) if isinstance(x, dict) else x if isinstance(x, tuple) else (x,)
    return all(bool(torch.isfinite(p).all()) for p in parts if p.is_floating_point())


class NonFiniteGuard:
    """One rank's check of its forwards, and (``SKIP``) the agreement at each update."""

    def __init__(
        self, policy: OnNonFinite, schedule: Schedule, rank: int, device: torch.device
    ) -> None:
        self.policy = policy
        self.device = device
        self.schedule = schedule
        self.rank = rank
        self.stage = schedule.stage_of_rank(rank)
        self.first_minibatch = 0
        self.skipped: list[int] = []
        self.overflowed = False
        self._bad: set[int] = set()

    def _minibatch(self, microbatch: int) -> int:
        if self.schedule.kind is ScheduleKind.PIPEDREAM:
            return microbatch
        return microbatch // self.schedule.microbatches_per_update

    def check(self, a: Action, out: Tensor, x: Tensor | tuple[Tensor, ...] | dict[str, Tensor],
              last: bool) -> None:
        """After forward ``a``: ``out`` is the stage's output, or the loss when ``last``."""
        if _all_finite(out):
            return
        k = self._minibatch(a.microbatch)
        if self.policy is OnNonFinite.SKIP:
            self._bad.add(k)
            return
        mb = self.first_minibatch + k
        per = self.schedule.microbatches_per_update
        part = "" if per == 1 else f" (microbatch {a.microbatch % per} of {per})"
        what = "loss" if last else "output"
        where = f"stage {self.stage} (rank {self.rank})"
        if not _finite(x):
            cause = (f"its input was not finite already: check minibatch {mb} of the data"
                     if self.stage == 0 else "its input from the previous stage was not finite")
        else:
            cause = (f"its input was finite, so the layers of stage {self.stage} made it: " + (
                "in float16, whose largest value is 65504, so a larger one is inf; train in "
                "bf16-mixed, or keep those layers' values smaller"
                if out.dtype == torch.float16 else
                "lower the learning rate or check those layers"))
        raise NonFiniteError(
            f"minibatch {mb}{part}: the {what} of {where} is not finite ({_what(out)}); "
            f"{cause}, or skip such minibatches with on_nonfinite=skip "
            "(--on-nonfinite skip)"
        )

    def skips(self, a: Action, group: Any, wait: Any, overflowed: bool | None = None) -> bool:
        """At ``STEP`` ``a``: whether any stage saw a non-finite value in this update.

        A collective over ``group`` (every rank) when the policy is ``SKIP`` or when
        ``overflowed`` is given: whether this rank's gradients were not finite under a
        loss scale (:mod:`.loss_scaling`), which skips the update on every stage without
        being an error. :attr:`overflowed` then says whether any rank's were.
        ``wait(work, a)`` waits for the collective with the run's deadline.
        """
        self.overflowed = False
        if self.policy is OnNonFinite.STOP and overflowed is None:
            return False
        n = self.schedule.num_stages
        mine = self.stage if a.microbatch in self._bad else n + self.stage if overflowed else 2 * n
        first = torch.tensor([mine], dtype=torch.int64, device=self.device)
        self._bad.discard(a.microbatch)
        work = dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group, async_op=True)
        wait(work, a)
        found = int(first.item())
        if found == 2 * n:
            return False
        mb = self.first_minibatch + a.microbatch
        self.skipped.append(mb)
        self.overflowed = found >= n
        if self.rank == 0 and self.overflowed:
            _log.info("skipped minibatch %d: the gradients of stage %d overflowed under the "
                      "loss scale, which is lowered; no stage updated its weights with it",
                      mb, found - n)
        elif self.rank == 0:
            _log.warning("skipped minibatch %d: a non-finite value first appeared at stage %d; "
                         "no stage updated its weights with it", mb, found)
        return True

    def norm_not_finite(self, a: Action, norm: float) -> None:
        """At ``STEP`` ``a`` of a clipped run: the gradients' global norm, the same on every
        rank (an all-reduce), is ``norm``, not finite, though no forward's output was. A
        gradient made it in the backward. ``SKIP``: the update is skipped (every rank reads
        the same norm, so every rank skips it); ``STOP``: a :class:`NonFiniteError`."""
        mb = self.first_minibatch + a.microbatch
        if self.policy is OnNonFinite.SKIP:
            self.skipped.append(mb)
            if self.rank == 0:
                _log.warning("skipped minibatch %d: its gradients' global norm is %s (a "
                             "backward made a non-finite gradient); no stage updated its "
                             "weights with it", mb, norm)
            return
        raise NonFiniteError(
            f"minibatch {mb}: the gradients' global norm is {norm} though every forward's "
            "output was finite, so a backward made a non-finite gradient; lower the learning "
            "rate or check the layers' backward, or skip such minibatches with "
            "on_nonfinite=skip (--on-nonfinite skip)")

"""How a rank runs its actions (:class:`RunnerOptions`), and which optimizer a stage builds.

Both are the same on every rank; :class:`~dreampipe.api.pipeline.Pipeline`
makes the runner's options from its own arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from dreampipe.runtime.nonfinite import OnNonFinite

__all__ = ["OptimizerKind", "RunnerOptions"]


class OptimizerKind(Enum):
    """The ``torch.optim`` optimizer each stage builds for its parameters."""

    SGD = "sgd"
    ADAM = "adam"


@dataclass(frozen=True, kw_only=True)
class RunnerOptions:
    """How a rank runs its actions (identical on every rank).

    ``max_grad_norm`` clips every update's gradient by its global norm over
    all stages (one small all-reduce over the world per update);
    ``autocast`` runs forwards under ``torch.autocast`` with that dtype.
    ``on_nonfinite`` says what a NaN or inf output or loss does (:mod:`.nonfinite`).
    """

    timeout_s: float = 60.0
    vertical_sync: bool = False
    record_events: bool = False
    max_grad_norm: float | None = None
    autocast: torch.dtype | None = None
    on_nonfinite: OnNonFinite = OnNonFinite.STOP

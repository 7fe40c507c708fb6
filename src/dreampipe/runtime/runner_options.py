"""How a rank runs its actions (:class:`RunnerOptions`), and which optimizer a stage builds.

Both are the same on every rank; a Pipeline's runner options come from its
:class:`~dreampipe.api.config.TrainConfig` (``runner_options()``), which
holds the defaults and the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from dreampipe.runtime.nonfinite import OnNonFinite
from dreampipe.runtime.precision import Precision

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
    ``precision``: the number formats (:mod:`.precision`), and under fp16-mixed the
    loss scale's start and window (:mod:`.loss_scaling`).
    ``on_nonfinite`` says what a NaN or inf output or loss does (:mod:`.nonfinite`).
    ``varying_shapes``: microbatches may change shape, so every activation sent carries
    its shape (:mod:`.comm`).
    """

    timeout_s: float
    vertical_sync: bool
    record_events: bool
    max_grad_norm: float | None
    precision: Precision
    on_nonfinite: OnNonFinite
    loss_scale: float = 2.0**16
    loss_scale_window: int = 2000
    varying_shapes: bool = False

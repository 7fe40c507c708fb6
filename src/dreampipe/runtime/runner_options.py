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

    @property
    def steps_agree(self) -> bool:
        """Whether every rank's first ``STEP`` of an update waits for every other rank's
        (:mod:`.update_actions`): to clip by the global norm, to learn whether a scaled
        16-bit loss overflowed anywhere, or to skip a minibatch that went non-finite
        anywhere. Asynchronous stages then wait for each other's backwards; the simulator
        prices it (:attr:`~dreampipe.simulation.action_costs.SimCosts.steps_agree`)."""
        return (self.max_grad_norm is not None or self.precision.scales_loss
                or self.on_nonfinite is OnNonFinite.SKIP)

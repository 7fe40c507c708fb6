"""What a stage keeps between a microbatch's forward and its backward (:class:`InFlight`),
and of the backward that completes a round (:class:`Round`); the one tensor a stage may
pass on (:func:`tensor_output`); where the input and last stages read a microbatch's
samples (:class:`MicrobatchData`). Plain records of :mod:`.stage_module` and
:mod:`.gradient_harvest`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from dreampipe.errors import ConfigError, PlanError
from dreampipe.runtime.recompute import Replay
from dreampipe.runtime.versions import Version

__all__ = ["InFlight", "MicrobatchData", "Round", "StageInput", "scalar_loss", "tensor_output"]


def tensor_output(out: object, where: str) -> Tensor:
    """``out`` if it is one tensor, the only thing a stage may pass on; else a PlanError
    that starts with ``where`` (``"stage 0 returned"``) and says where to cut instead."""
    if not isinstance(out, Tensor):
        raise PlanError(
            f"{where} a {type(out).__name__}, not a tensor; dreampipe passes one tensor "
            "between stages: cut the model after a layer that returns a tensor"
        )
    return out


def scalar_loss(loss: object) -> Tensor:
    """``loss`` if it is a scalar tensor, what ``loss_fn`` must return; else a ConfigError
    naming what it returned and the fix."""
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, Tensor) else (
            f"a {type(loss).__name__}")
        raise ConfigError(
            f"loss_fn returned {what}, not a scalar; return one number per minibatch, e.g. "
            "the mean (reduction='mean')", "loss_fn",
        )
    return loss


@dataclass
class Round:
    """The backward completing a round: who to tell, and the versions to harvest from."""

    on_ready: Callable[[int, Tensor], None]
    leaves: list[list[Tensor]]
    reported: list[bool]


#: A stage's input: one tensor, or (first stage only) the tuple or dict of the model's inputs.
StageInput = Tensor | tuple[Tensor, ...] | dict[str, Tensor]


@dataclass
class InFlight:
    """What a stage keeps of a microbatch from its forward to its backward: the input, the
    output to differentiate (None while recomputing), the weight version, the target and
    loss share, and what a recomputing stage replays."""

    input: StageInput
    output: Tensor | None
    version: Version | None
    target: Tensor | None
    scale: float
    replay: Replay | None = None


class MicrobatchData(Protocol):
    """The samples of a microbatch, the same on every rank that asks."""

    def inputs(self, microbatch: int) -> StageInput:
        """The input stage's input of ``microbatch``."""

    def targets(self, microbatch: int) -> Tensor:
        """The last stage's targets of ``microbatch``."""

    def share(self, microbatch: int) -> float:
        """What ``microbatch``'s loss counts beside its minibatch's others (1: equal parts)."""

"""What to run and what came back: :class:`RunConfig` and :class:`RunResult`.

A run trains ``steps`` weight updates of ``minibatch_size`` samples each. How
an update is cut into *units* (the ``unit`` of every :class:`~dreampipe.scheduling.actions.Action`)
depends on the schedule::

    schedule                units per update            samples per unit
    pipedream               1 (a unit is a minibatch)   minibatch_size
    1f1b-flush/gpipe/naive  microbatches                minibatch_size / microbatches
    dp on N workers         N * microbatches            minibatch_size / (N * microbatches)

so for ``dp`` the ``microbatches`` option counts microbatches *per worker*
(gradient accumulation on each worker), and every worker gets the same share.
Unit ``u`` always holds samples ``u*size .. (u+1)*size-1`` of the data stream,
so the same run split into more microbatches sees the same samples.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from dreampipe.errors import PlanError
from dreampipe.models import get_model
from dreampipe.models.spec import ModelSpec
from dreampipe.planning.plan import Plan
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.events import Event

__all__ = [
    "OptimizerKind",
    "RunConfig",
    "RunResult",
    "resolve_model",
    "units_per_update",
]


def units_per_update(kind: ScheduleKind, microbatches: int, workers: int) -> int:
    """Scheduled units per weight update (the table above).

    One minibatch for PipeDream; ``microbatches`` for the pipelined
    synchronous schedules; ``microbatches`` per worker for data parallelism.
    """
    if kind is ScheduleKind.PIPEDREAM:
        return 1
    if kind is ScheduleKind.DP:
        return microbatches * workers
    return microbatches


class OptimizerKind(Enum):
    """The ``torch.optim`` optimizer each stage builds for its parameters."""

    SGD = "sgd"
    ADAM = "adam"


@dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs; identical on every rank.

    ``model`` is a zoo name (:func:`dreampipe.models.get_model`) or
    ``"package.module:factory"``, a function returning a
    :class:`~dreampipe.models.spec.ModelSpec` (called with ``model_kwargs``).
    ``stash=False`` turns weight stashing off (PipeDream's "naive pipelining",
    see :mod:`dreampipe.runtime.stage`); ``vertical_sync`` makes every stage
    run a minibatch with the weight version its input stage used.
    ``timeout_s`` bounds every wait for a peer. ``backend`` None picks NCCL
    when CUDA is available, gloo otherwise.
    """

    model: str
    plan: Plan
    schedule: ScheduleKind = ScheduleKind.PIPEDREAM
    minibatch_size: int = 32
    microbatches: int = 1
    steps: int = 10
    optimizer: OptimizerKind = OptimizerKind.SGD
    lr: float = 0.01
    momentum: float = 0.0
    seed: int = 0
    stash: bool = True
    vertical_sync: bool = False
    timeout_s: float = 60.0
    dataset: str = "synthetic"
    data_dir: str | None = None
    model_kwargs: tuple[tuple[str, Any], ...] = ()
    record_events: bool = False
    evaluate: bool = True
    backend: str | None = None
    progress: bool = False

    @property
    def workers(self) -> int:
        """Processes the plan uses (every replica of every stage)."""
        return self.plan.workers_used

    @property
    def units_per_update(self) -> int:
        """Scheduled units (minibatches or microbatches) per weight update; see above."""
        return units_per_update(self.schedule, self.microbatches, self.workers)

    @property
    def unit_size(self) -> int:
        """Samples per unit (minibatch or microbatch)."""
        return self.minibatch_size // self.units_per_update

    @property
    def num_units(self) -> int:
        """Units in the whole run."""
        return self.steps * self.units_per_update

    @property
    def backend_name(self) -> str:
        """``backend``, else NCCL with CUDA and gloo without."""
        if self.backend is not None:
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass(frozen=True)
class RunResult:
    """What a run measured. Times in seconds; ``events`` share one time origin.

    ``losses`` has one entry per weight update (per minibatch for pipedream):
    the mean loss of that update's samples, computed by the last stage.
    ``stage_states`` holds each stage's final ``state_dict`` (replica 0), on CPU.
    """

    samples_per_s: float
    final_loss: float
    losses: tuple[float, ...]
    accuracy: float | None
    events: tuple[Event, ...]
    elapsed_s: float
    stage_states: tuple[dict[str, torch.Tensor], ...]


def resolve_model(cfg: RunConfig) -> ModelSpec:
    """The :class:`ModelSpec` named by ``cfg.model`` (zoo name or ``module:factory``)."""
    kwargs = dict(cfg.model_kwargs)
    if ":" not in cfg.model:
        return get_model(cfg.model, **kwargs)
    module_name, _, attr = cfg.model.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PlanError(
            f"model {cfg.model!r}: cannot import {attr!r} from {module_name!r} ({exc}); "
            "give a zoo name or 'package.module:function' returning a ModelSpec"
        ) from exc
    spec = factory(**kwargs)
    if not isinstance(spec, ModelSpec):
        raise PlanError(
            f"model {cfg.model!r} returned {type(spec).__name__}, not a ModelSpec"
        )
    return spec

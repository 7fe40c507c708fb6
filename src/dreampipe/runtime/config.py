"""What to run and what came back: :class:`RunConfig` and :class:`RunResult`.

A run trains ``steps`` weight updates of ``minibatch_size`` samples each;
how an update is cut into scheduled units is
:class:`~dreampipe.scheduling.units.UnitLayout`'s (:attr:`RunConfig.layout`).
:class:`RunOptions` is everything but the plan, so a job can hold a run's
options before it has planned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from dreampipe.planning.plan import Plan
from dreampipe.runtime.nonfinite import OnNonFinite
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.events import Event
from dreampipe.scheduling.units import UnitLayout

if TYPE_CHECKING:
    from dreampipe.runtime.memory import MemoryUse

__all__ = ["OptimizerKind", "RunConfig", "RunOptions", "RunResult", "RunnerOptions"]


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
    ``unit_size`` only feeds the progress bar's samples/s. ``on_nonfinite``
    says what a NaN or inf output or loss does (:mod:`.nonfinite`).
    """

    timeout_s: float = 60.0
    vertical_sync: bool = False
    record_events: bool = False
    progress: bool = False
    unit_size: int = 1
    max_grad_norm: float | None = None
    autocast: torch.dtype | None = None
    on_nonfinite: OnNonFinite = OnNonFinite.STOP


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """Everything a training run needs but its plan; identical on every rank.

    ``model`` is a reference :func:`dreampipe.models.resolve.resolve_spec`
    accepts (a zoo name, ``package.module:factory`` or ``file.py:function``
    returning a :class:`~dreampipe.models.spec.ModelSpec`), called with
    ``model_kwargs``. ``stash=False`` turns weight stashing off (PipeDream's
    "naive pipelining", see :mod:`dreampipe.runtime.stage`); ``vertical_sync``
    makes every stage run a minibatch with the weight version its input stage
    used. ``fused_accumulation=False`` makes ``nn.Linear`` weight gradients
    with autograd's kernels (a GEMM, then an add) instead of
    :mod:`~dreampipe.runtime.fused`'s one GEMM, in the same order.
    ``timeout_s`` bounds every wait for a peer. ``on_nonfinite`` says what a
    NaN or inf output or loss does (:mod:`~dreampipe.runtime.nonfinite`).
    ``backend`` None picks NCCL when CUDA is available, gloo otherwise.
    ``measure_memory`` measures each rank's peak memory
    (:mod:`~dreampipe.runtime.memory`); on CPU that gives large tensors pages
    of their own, which slows training.
    """

    model: str
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
    fused_accumulation: bool = True
    timeout_s: float = 60.0
    dataset: str = "synthetic"
    data_dir: str | None = None
    model_kwargs: tuple[tuple[str, Any], ...] = ()
    record_events: bool = False
    evaluate: bool = True
    backend: str | None = None
    progress: bool = False
    on_nonfinite: OnNonFinite = OnNonFinite.STOP
    measure_memory: bool = False

    def optimizer_factory(self) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
        """What each stage calls with its own parameters to build its optimizer."""
        def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            if self.optimizer is OptimizerKind.ADAM:
                return torch.optim.Adam(params, lr=self.lr)
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)

        return build

    def with_plan(self, plan: Plan, steps: int) -> RunConfig:
        """These options run as ``steps`` updates of ``plan``."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return RunConfig(**{**fields, "steps": steps}, plan=plan)


@dataclass(frozen=True, kw_only=True)
class RunConfig(RunOptions):
    """:class:`RunOptions` plus the plan they run."""

    plan: Plan

    @property
    def workers(self) -> int:
        """Processes the plan uses (every replica of every stage)."""
        return self.plan.workers_used

    @cached_property
    def layout(self) -> UnitLayout:
        """How each update is cut into units; raises a ConfigError if it cannot be."""
        return UnitLayout(kind=self.schedule, minibatch_size=self.minibatch_size,
                          microbatches=self.microbatches, workers=self.workers)

    def runner_options(self) -> RunnerOptions:
        """The options every rank's :class:`~dreampipe.runtime.engine.RankRunner` runs with."""
        return RunnerOptions(
            timeout_s=self.timeout_s, vertical_sync=self.vertical_sync,
            record_events=self.record_events, progress=self.progress,
            unit_size=self.layout.unit_size, on_nonfinite=self.on_nonfinite,
        )

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
    ``stage_states`` holds each stage's final ``state_dict`` (replica 0), on CPU;
    ``memory`` each rank's peak memory, by rank, where the run measured it.
    """

    samples_per_s: float
    final_loss: float
    losses: tuple[float, ...]
    accuracy: float | None
    events: tuple[Event, ...]
    elapsed_s: float
    stage_states: tuple[dict[str, torch.Tensor], ...]
    memory: tuple[MemoryUse, ...] = ()


"""What ``dreampipe train`` (and ``demo``) runs and what comes back, and its checks.

:class:`TrainOptions` is a run but for its plan, so ``dreampipe train`` can
check and hold it before it has profiled and planned; :class:`TrainConfig`
adds the plan. Both are plain records: :func:`dreampipe.commands.train.train_local`
and ``run_train`` train them, one :class:`~dreampipe.api.pipeline.Pipeline`
per rank. A run trains ``steps`` weight updates of ``minibatch_size``
samples each; how an update is cut into scheduled units is
:class:`~dreampipe.scheduling.units.UnitLayout`'s (:attr:`TrainConfig.layout`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from dreampipe.errors import ConfigError, DatasetError, PlanError, ScheduleError
from dreampipe.models.spec import ModelSpec
from dreampipe.planning.placement import check_schedule, virtual_stages_of
from dreampipe.planning.plan import Plan
from dreampipe.runtime.config import OptimizerKind
from dreampipe.runtime.data import DATASETS
from dreampipe.runtime.nonfinite import OnNonFinite, check_policy
from dreampipe.runtime.two_bw import check_two_versions
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.events import Event
from dreampipe.scheduling.units import UnitLayout

if TYPE_CHECKING:
    from dreampipe.runtime.memory import MemoryUse

__all__ = ["TrainConfig", "TrainOptions", "TrainResult", "check_config", "check_options"]


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """Everything a training run needs but its plan; identical on every rank.

    ``model`` is a reference :func:`dreampipe.models.resolve.resolve_spec`
    accepts (a zoo name, ``package.module:factory`` or ``file.py:function``
    returning a :class:`~dreampipe.models.spec.ModelSpec`), called with
    ``model_kwargs``. ``stash=False`` turns weight stashing off (PipeDream's
    "naive pipelining", see :mod:`dreampipe.runtime.stage`); ``vertical_sync``
    makes every stage run a minibatch with the weight version its input stage
    used. ``compensate`` turns staleness compensation on for the asynchronous
    schedules (:mod:`~dreampipe.runtime.staleness`). ``fused_accumulation=False`` makes
    ``nn.Linear`` weight gradients with autograd's kernels (a GEMM, then an add) instead of
    :mod:`~dreampipe.runtime.fused`'s one GEMM, in the same order.
    ``timeout_s`` bounds every wait for a peer. ``on_nonfinite`` says what a
    NaN or inf output or loss does (:mod:`~dreampipe.runtime.nonfinite`).
    ``evaluate`` measures test accuracy after training, where the dataset has
    a test split. ``progress`` shows a bar of minibatches on the last rank.
    ``virtual_stages`` (interleaved-1f1b) is the stages per worker asked for: the
    plan's own count (None: whatever the plan says).
    ``measure_memory`` measures each rank's peak memory
    (:mod:`~dreampipe.runtime.memory`); on CPU that gives large tensors pages
    of their own, which slows training.
    """

    model: str
    schedule: ScheduleKind = ScheduleKind.PIPEDREAM
    minibatch_size: int = 32
    microbatches: int = 1
    virtual_stages: int | None = None
    steps: int = 10
    optimizer: OptimizerKind = OptimizerKind.SGD
    lr: float = 0.01
    momentum: float = 0.0
    seed: int = 0
    stash: bool = True
    vertical_sync: bool = False
    compensate: bool = True
    fused_accumulation: bool = True
    timeout_s: float = 60.0
    dataset: str = "synthetic"
    data_dir: str | None = None
    model_kwargs: tuple[tuple[str, Any], ...] = ()
    record_events: bool = False
    evaluate: bool = True
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

    def with_plan(self, plan: Plan, steps: int) -> TrainConfig:
        """These options run as ``steps`` updates of ``plan``."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return TrainConfig(**{**fields, "steps": steps}, plan=plan)


@dataclass(frozen=True, kw_only=True)
class TrainConfig(TrainOptions):
    """:class:`TrainOptions` plus the plan they run, which says its stages per worker."""

    plan: Plan

    @property
    def workers(self) -> int:
        """Processes the plan uses (every replica of every stage, every worker of a split one;
        a plan's stages / its ``virtual_stages`` under interleaving)."""
        return self.plan.workers_used

    @cached_property
    def layout(self) -> UnitLayout:
        """How each update is cut into units; raises a ConfigError if it cannot be."""
        return UnitLayout(kind=self.schedule, minibatch_size=self.minibatch_size,
                          microbatches=self.microbatches, workers=self.workers)


@dataclass(frozen=True)
class TrainResult:
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


def check_options(opts: TrainOptions) -> None:
    """The checks that need no plan, so ``dreampipe train`` runs them before profiling.

    How an update splits into units is :class:`~dreampipe.scheduling.units.UnitLayout`'s
    rule, checked where a layout is made.
    """
    if opts.steps < 1:
        raise ConfigError(f"steps={opts.steps}; use 1 or more", "steps")
    if opts.timeout_s <= 0:
        raise ConfigError(f"timeout_s={opts.timeout_s}; use a positive number of seconds",
                          "timeout_s")
    if opts.lr <= 0:
        raise ConfigError(f"lr={opts.lr}: the learning rate must be positive, such as 0.01",
                          "lr")
    if opts.schedule is not ScheduleKind.PIPEDREAM and (opts.vertical_sync or not opts.stash):
        raise ConfigError(
            f"vertical sync and turning weight stashing off apply to the pipedream schedule "
            f"only; {opts.schedule.value} updates all stages together"
        )
    if opts.vertical_sync and not opts.stash:
        raise ConfigError(
            "vertical sync runs every stage on a stashed weight version; it needs weight "
            "stashing: drop stash=False or vertical_sync=True", "stash", "vertical_sync",
        )
    check_policy(opts.on_nonfinite, opts.schedule)
    v = opts.virtual_stages
    if v is not None and (v < 1 or (v > 1 and opts.schedule is not ScheduleKind.INTERLEAVED)):
        raise ConfigError(f"--virtual-stages {v} with --schedule {opts.schedule.value}; use 1, "
                          "or --schedule interleaved-1f1b with 2 or more", "virtual_stages")
    if opts.dataset not in DATASETS:
        raise DatasetError(f"unknown dataset {opts.dataset!r}; use one of {', '.join(DATASETS)}")


def check_config(cfg: TrainConfig, spec: ModelSpec, world: int | None = None) -> None:
    """Raise a :class:`~dreampipe.errors.DreampipeError` naming what is wrong and the fix.

    Run in the parent, before any rank starts; each rank's Pipeline checks
    its own arguments again (:mod:`dreampipe.api.checks`).
    """
    plan = cfg.plan
    virtual_stages_of(plan, cfg.virtual_stages)
    check_schedule(plan, cfg.schedule.value)
    if world is not None and world != cfg.workers:
        raise PlanError(
            f"the plan {plan.config} uses {cfg.workers} workers but {world} were started; "
            f"start {cfg.workers} workers or plan for {world}"
        )
    if plan.num_stages > spec.num_layers:
        raise PlanError(
            f"the plan has {plan.num_stages} stages but {spec.name} has only "
            f"{spec.num_layers} layers; use at most {spec.num_layers} stages"
        )
    if plan.num_layers != spec.num_layers:
        raise PlanError(
            f"the plan is for a model of {plan.num_layers} layers but {spec.name} has "
            f"{spec.num_layers}; plan again for this model"
        )
    if plan.layer_names and tuple(plan.layer_names) != tuple(spec.layer_names):
        diff = next(
            i for i, (a, b) in enumerate(zip(plan.layer_names, spec.layer_names, strict=True))
            if a != b
        )
        raise PlanError(
            f"the plan is for another model: its layer {diff} is {plan.layer_names[diff]!r} but "
            f"{spec.name}'s is {spec.layer_names[diff]!r}; plan again for this model"
        )
    check_options(cfg)
    _ = cfg.layout
    _check_schedule(cfg)


def _check_schedule(cfg: TrainConfig) -> None:
    replicas = {st.replicas for st in cfg.plan.stages}
    if cfg.vertical_sync and len(replicas) > 1:
        raise ConfigError(
            f"vertical sync needs the same replica count in every stage (got "
            f"{cfg.plan.config}): a stage's version counts its own updates, so stages that "
            "update at different rates name different weights by one number (and the faster "
            "one keeps ever more versions); drop vertical_sync=True or replicate stages equally",
            "vertical_sync",
        )
    if cfg.schedule is ScheduleKind.TWO_BW:
        check_two_versions(cfg.layout.build([st.replicas for st in cfg.plan.stages], 3))
    if cfg.schedule is ScheduleKind.DP and cfg.plan.num_stages != 1:
        raise ScheduleError(
            f"the dp schedule needs a one-stage plan (config like '{cfg.workers}'), "
            f"got {cfg.plan.config}"
        )

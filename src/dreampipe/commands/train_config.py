"""What ``dreampipe train`` (and ``demo``) runs and what comes back, and its checks.

:class:`TrainOptions` is a run but for its plan: the model, its data and optimizer,
and the :class:`~dreampipe.api.config.TrainConfig` every rank's Pipeline trains with,
so ``dreampipe train`` can check and hold it before it has profiled and planned;
:class:`TrainRun` adds the plan. Both are plain records:
:func:`dreampipe.commands.train_run.train_local` and ``run_train`` train them, one
:class:`~dreampipe.api.pipeline.Pipeline` per rank. A run trains ``steps`` weight
updates of ``minibatch_size`` samples each; how an update is cut into microbatches
is :class:`~dreampipe.scheduling.microbatch_layout.MicrobatchLayout`'s (:attr:`TrainRun.layout`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from dreampipe.api.checks import check_schedule as check_plan_schedule
from dreampipe.api.config import TrainConfig
from dreampipe.commands.seq_lengths import check_token_model
from dreampipe.errors import ConfigError, DatasetError, PlanError
from dreampipe.machine.step_time import prediction_factor, step_factor
from dreampipe.models.datasets import DATASETS
from dreampipe.models.resolve import resolve_spec
from dreampipe.models.spec import ModelSpec
from dreampipe.planning.placement import check_schedule, virtual_stages_of
from dreampipe.planning.plan import Plan
from dreampipe.runtime.memory import TrainingChoices
from dreampipe.runtime.optimizer_step import NO_STEP_BYTES, StepBytes, measure_step_bytes
from dreampipe.runtime.runner_options import OptimizerKind
from dreampipe.runtime.staleness import predicting
from dreampipe.runtime.two_bw import check_two_versions
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.events import Event
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout

if TYPE_CHECKING:
    from dreampipe.runtime.memory_meter import MemoryUse

__all__ = ["TrainOptions", "TrainResult", "TrainRun", "check_options", "check_run"]


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """Everything a training run needs but its plan; identical on every rank.

    ``model`` is a reference :func:`dreampipe.models.resolve.resolve_spec`
    accepts (a zoo name, ``package.module:factory`` or ``file.py:function``
    returning a :class:`~dreampipe.models.spec.ModelSpec`), called with
    ``model_kwargs``. ``config`` is how every rank's Pipeline trains (schedule,
    microbatches, weight stashing, timeouts...). ``evaluate`` measures test
    accuracy after training, where the dataset has a test split. ``progress``
    shows a bar of minibatches on the last rank. ``config.measure_memory`` measures
    each rank's peak memory (:mod:`~dreampipe.runtime.memory_meter`); on CPU every
    operation is then counted, which slows training. ``seq_lengths``
    ``(MIN, MAX)``: each step's token sequences cut to a length between them
    (:mod:`~dreampipe.commands.seq_lengths`).
    """

    model: str
    config: TrainConfig = TrainConfig()
    minibatch_size: int = 32
    steps: int = 10
    optimizer: OptimizerKind = OptimizerKind.SGD
    lr: float = 0.01
    momentum: float = 0.0
    dataset: str = "synthetic"
    data_dir: str | None = None
    model_kwargs: tuple[tuple[str, Any], ...] = ()
    evaluate: bool = True
    progress: bool = False
    seq_lengths: tuple[int, int] | None = None

    @property
    def measure_memory(self) -> bool:
        """Whether each rank measures its peak memory (the config's ``measure_memory``)."""
        return self.config.measure_memory

    def optimizer_factory(self, foreach: bool | None = None
                          ) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
        """What each stage calls with its own parameters to build its optimizer
        (``foreach``: PyTorch's multi-tensor form; None: its default for the device)."""
        def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            if self.optimizer is OptimizerKind.ADAM:
                return torch.optim.Adam(params, lr=self.lr, foreach=foreach)
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                                   foreach=foreach)

        return build

    def step_factor(self) -> float:
        """How many plain SGD steps' time a step of this run's optimizer takes, on the
        ranks' device (:func:`~dreampipe.machine.step_time.step_factor`): 1 for plain SGD,
        the step the machine's rates time."""
        if self.optimizer is OptimizerKind.SGD and not self.momentum:
            return 1.0
        device = _ranks_device()
        return step_factor(self.optimizer_factory(
            foreach=True if device is not None else None), device)

    def prediction_factor(self) -> float:
        """The work weight prediction adds to a delayed stage's update, in plain SGD steps
        (:func:`~dreampipe.machine.step_time.prediction_factor`), on the ranks' device; 0
        where no stage predicts: a synchronous schedule, compensation or stashing off, or
        an optimizer other than Adam (:func:`~dreampipe.runtime.staleness.predicting`)."""
        config = self.config
        if not predicting(config.kind, self.memory_choices(step=False).hyper,
                          compensate=config.compensate, stash=config.stash):
            return 0.0
        return prediction_factor(_ranks_device())

    def memory_choices(self, *, step: bool = True) -> TrainingChoices:
        """What the memory a stage takes depends on among these options (without ``step``,
        the optimizer step's temporaries, which stepping probes measures, left out)."""
        return TrainingChoices(optimizer=self.optimizer, momentum=self.momentum,
                               stash=self.config.stash, vertical_sync=self.config.vertical_sync,
                               compensate=self.config.compensate,
                               precision=self.config.number_formats,
                               recompute_blocks=self.config.recompute_blocks,
                               zero=self.config.zero,
                               block=self._block(),
                               step_bytes=self.step_bytes() if step else NO_STEP_BYTES)

    def step_bytes(self) -> StepBytes:
        """The optimizer step's temporaries, measured by stepping probes on the CPU, in the
        form the ranks' device defaults to (:func:`~.optimizer_step.measure_step_bytes`)."""
        return measure_step_bytes(self.optimizer_factory(
            foreach=True if _ranks_device() is not None else None))

    def _block(self) -> str | None:
        """The model's block class, where its blocks are recomputed (its layers on meta)."""
        spec = self.config.block_recompute()
        if spec is None:
            return None
        with torch.device("meta"):
            layers = resolve_spec(self.model, self.model_kwargs).build()
        return spec.for_model(layers).block

    def with_plan(self, plan: Plan, steps: int) -> TrainRun:
        """These options run as ``steps`` updates of ``plan``."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(TrainOptions)}
        return TrainRun(**{**fields, "steps": steps}, plan=plan)


def _ranks_device() -> torch.device | None:
    """The device the ranks train on, where the probes run: the GPU, None for the CPU
    (where the optimizer's default form is its single-tensor one)."""
    return torch.device("cuda") if torch.cuda.is_available() else None


@dataclass(frozen=True, kw_only=True)
class TrainRun(TrainOptions):
    """:class:`TrainOptions` plus the plan they run, which says its stages per worker."""

    plan: Plan

    @property
    def workers(self) -> int:
        """Processes the plan uses (every replica of every stage, every worker of a split one;
        a plan's stages / its ``virtual_stages`` under interleaving)."""
        return self.plan.workers_used

    @cached_property
    def layout(self) -> MicrobatchLayout:
        """How each update is cut into microbatches; raises a ConfigError if it cannot be."""
        return MicrobatchLayout(kind=self.config.kind, minibatch_size=self.minibatch_size,
                                microbatches=self.config.per_minibatch, workers=self.workers)


@dataclass(frozen=True)
class TrainResult:
    """What a run measured. Times in seconds; ``events`` share one time origin.

    ``losses`` has one entry per weight update (per minibatch for pipedream):
    the mean loss of that update's samples, computed by the last stage.
    ``stage_states`` holds each stage's final ``state_dict`` (replica 0), on CPU;
    ``memory`` each rank's peak memory, by rank, where the run measured it.
    With ``seq_lengths``: each step's sequence ``lengths`` and rank 0's ``step_s``.
    """

    samples_per_s: float
    final_loss: float
    losses: tuple[float, ...]
    accuracy: float | None
    events: tuple[Event, ...]
    elapsed_s: float
    stage_states: tuple[dict[str, torch.Tensor], ...]
    memory: tuple[MemoryUse, ...] = ()
    lengths: tuple[int, ...] = ()
    step_s: tuple[float, ...] = ()


def check_options(opts: TrainOptions) -> None:
    """The checks that need no plan, so ``dreampipe train`` runs them before profiling.

    The config's own rules are :class:`~dreampipe.api.config.TrainConfig`'s, checked when it was
    made; how an update splits into microbatches is
    :class:`~dreampipe.scheduling.microbatch_layout.MicrobatchLayout`'s, checked where a layout is
    made.
    """
    if opts.steps < 1:
        raise ConfigError(f"steps={opts.steps}; use 1 or more", "steps")
    if not (math.isfinite(opts.lr) and opts.lr > 0):  # NaN fails every comparison
        raise ConfigError(f"lr={opts.lr}: the learning rate must be positive, such as 0.01",
                          "lr")
    if not (math.isfinite(opts.momentum) and opts.momentum >= 0):
        raise ConfigError(f"momentum={opts.momentum}: SGD's momentum must be 0 or more, such "
                          "as 0.9 (0: none)", "momentum")
    if opts.dataset not in DATASETS:
        raise DatasetError(f"unknown dataset {opts.dataset!r}; use one of {', '.join(DATASETS)}")
    if opts.data_dir is not None and opts.dataset != "mnist":
        raise ConfigError(f"data_dir={opts.data_dir!r} with dataset={opts.dataset}, which reads "
                          "no files; give dataset=mnist to read MNIST from it, or drop "
                          "data_dir", "data_dir", "dataset")
    if opts.config.resume is not None:
        raise ConfigError(f"a train run resumes from checkpoint_dir=DIR with resume=True, not "
                          f"from its config's resume={opts.config.resume!r}: drop that",
                          "checkpoint_dir", "resume")


def check_run(run: TrainRun, spec: ModelSpec, world: int | None = None) -> None:
    """Raise a :class:`~dreampipe.errors.DreampipeError` naming what is wrong and the fix.

    Run in the parent, before any rank starts; each rank's Pipeline checks
    its own arguments again (:mod:`dreampipe.api.checks`).
    """
    plan = run.plan
    virtual_stages_of(plan, run.config.virtual_stages)
    check_schedule(plan, run.config.schedule)
    if world is not None and world != run.workers:
        raise PlanError(
            f"the plan {plan.config} uses {run.workers} workers but {world} were started; "
            f"start {run.workers} workers or plan for {world}"
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
    check_options(run)
    if run.seq_lengths is not None:
        check_token_model(spec, run.seq_lengths)
    _ = run.layout
    check_plan_schedule(run.config, plan)
    if run.config.kind is ScheduleKind.TWO_BW:
        check_two_versions(run.layout.build([st.replicas for st in plan.stages], 3))
    if plan.has_splits:  # what each split stage's layers can run, before any rank starts
        from dreampipe.api.settled_plan import check_split_stages
        from dreampipe.splitter.sequential import sequential_entries

        with torch.device("meta"):
            check_split_stages(sequential_entries(spec.build(seed=run.config.seed)), plan)

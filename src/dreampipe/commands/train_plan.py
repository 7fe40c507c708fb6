"""``dreampipe train``'s plan choice: check, profile, plan and predict, locally or under torchrun.

The run itself is :func:`dreampipe.commands.train_run.run_train`'s, on a
:class:`~dreampipe.api.Pipeline` per rank.

Locally, dreampipe profiles the model (or reads a saved profile of it),
plans it for the workers asked for, and starts those worker processes
itself. Under ``torchrun`` the processes already exist, one per rank, and
every rank must run the *same* plan; but a profile is a measurement and
differs a little from rank to rank. So only rank 0 profiles and plans; when
the planner chose the plan, rank 0 shares it with the others
(:mod:`dreampipe.commands.train_share`). A plan file or a forced partition
needs no exchange.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dreampipe.commands.seq_lengths import check_token_model
from dreampipe.commands.train_config import TrainOptions, TrainRun, check_options, check_run
from dreampipe.commands.train_share import share_plan
from dreampipe.errors import ConfigError, PlanError
from dreampipe.machine.calibration import (
    LocalCalibration,
    corun_crowd,
    corun_twins,
    measured_topology,
)
from dreampipe.machine.measure import machine_for_run
from dreampipe.machine.torchrun import torchrun_nodes
from dreampipe.models.datasets import load_dataset, steps_for_epochs
from dreampipe.models.resolve import resolve_spec
from dreampipe.models.spec import ModelSpec
from dreampipe.planning.config_string import stages_from_config
from dreampipe.planning.memory_terms import SENDS_KEPT
from dreampipe.planning.placement import Placement, check_schedule, virtual_stages_of
from dreampipe.planning.plan import Plan
from dreampipe.planning.planner import memory_needs
from dreampipe.planning.split_stage import unfit_lines
from dreampipe.profiling.fixed_costs import with_small_batch
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runplan.plan_choice import PlanAsk, choose_plan, forced_partition
from dreampipe.runplan.prediction import predict_samples_per_s
from dreampipe.runplan.schedule_choice import small_profile_batch
from dreampipe.runplan.worker_profile import profile_as_worker, saved_profile
from dreampipe.runtime.memory import (
    check_memory,
    counted_twice,
    planner_terms,
    predict_memory,
)
from dreampipe.runtime.optimizer_step import StepBytes
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout

if TYPE_CHECKING:
    from dreampipe.models.datasets import Dataset

__all__ = [
    "PlanSource",
    "PlannedRun",
    "TrainRequest",
    "plan_train",
]

log = logging.getLogger(__name__)

#: Seconds of timed passes in train's profile at least. A small model's 5 passes
#: take a fraction of a second, and a host's speed drifts over seconds: a profile
#: of a fraction of a second measures the drift more than the model.
PROFILE_MIN_S = 1.0

Say = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class PlanSource:
    """Where a train job's plan comes from: a plan file, a forced partition, else the planner.

    ``config`` (``"2-1"``) and ``stages`` (``"0,4"``) force replicas per
    stage and first layers, as :func:`~dreampipe.runplan.plan_choice.forced_partition` reads them.
    """

    path: str | None = None
    config: str | None = None
    stages: str | None = None

    def __post_init__(self) -> None:
        if self.path is not None and (self.config or self.stages):
            raise ConfigError(
                f"plan_path={self.path!r} with config/stages: give a plan file or a partition, "
                "not both", "plan_path",
            )

    @property
    def planner_chooses(self) -> bool:
        """No file and no first layers: rank 0's planner picks the plan or its cuts."""
        return self.path is None and self.stages is None


@dataclass(frozen=True, kw_only=True)
class TrainRequest:
    """What ``dreampipe train`` was asked to do (see its ``--help``).

    ``run`` is the run but for its plan, which comes from ``plan``. ``profile``
    is a saved layer profile to plan and predict with instead of profiling first.
    ``workers`` None means: the forced config's total, else 2. ``memory_bytes``
    is each worker's memory: the planner plans within it, and a plan whose
    predicted memory does not fit is an error. ``epochs``
    replaces ``run.steps`` with the updates that cover that many passes over
    the data. Steps are rounded up to whole all-reduce rounds of the plan,
    unless ``exact_steps`` (they were asked for): then a partial round is an error.
    Under ``run.config.schedule == "auto"`` the simulator chooses the fastest
    schedule of its semantics on the plan.
    """

    run: TrainOptions
    plan: PlanSource = PlanSource()
    workers: int | None = None
    epochs: float | None = None
    exact_steps: bool = False
    memory_bytes: int | None = None
    profile: str | None = None


@dataclass(frozen=True)
class PlannedRun:
    """A train job ready to run: the run with its plan, its model and the predictions
    (memory per stage: empty where this rank did not profile)."""

    run: TrainRun
    spec: ModelSpec
    predicted_samples_per_s: float
    predicted_memory: tuple[int, ...] = ()
    #: Per rank, what the sum of its stages' predictions counts twice (several stages).
    counted_twice: tuple[int, ...] = ()


def plan_train(
    req: TrainRequest, *, torchrun: tuple[int, int] | None = None, say: Say | None = None
) -> PlannedRun:
    """Check, profile, plan and predict a train job (:mod:`dreampipe.commands.train_run` runs it).

    ``torchrun`` is ``(rank, world_size)`` when the processes were started by
    torchrun; otherwise the job plans for local workers. ``say`` receives the
    human-readable lines (plan, prediction) on the reporting rank.
    """
    opts = req.run
    spec = resolve_spec(opts.model, opts.model_kwargs)
    workers = _workers(req, torchrun)
    step_bytes = opts.step_bytes()  # once: it steps the optimizer on probes
    ask = _plan_ask(req, workers, step_bytes, local=torchrun is None)
    lead = torchrun is None or torchrun[0] == 0
    nodes = 1 if torchrun is None else torchrun_nodes(workers)
    talk = say if say is not None and lead else _quiet
    # a local job fails on a bad option before it measures the machine; under torchrun
    # every rank measures first, together
    early = None if torchrun is not None else _check_before_profiling(
        req, ask, spec, workers, fixed_world=False)
    machine = machine_for_run(workers, nodes=nodes, say=talk)  # every rank: it may measure
    graph: LayerGraph | None = None
    plan: Plan | None = None
    chosen: tuple[ScheduleKind, int] | None = None
    if lead:
        steps, given = early if early is not None else _check_before_profiling(
            req, ask, spec, workers, fixed_world=True)
        graph = _profile(req, spec, ask, machine, local=torchrun is None)
        small = small_profile_batch(workers, opts.minibatch_size, graph.batch_size)
        if ask.semantics is not None and req.profile is None and small:
            # the choice prices microbatches of other sizes: the fixed part of each call too
            graph = with_small_batch(graph, _profile(req, spec, ask, machine,
                                                     local=torchrun is None, size=small))
        picked = choose_plan(graph, measured_topology(graph, workers, machine, nodes=nodes),
                             dataclasses.replace(ask, given=given, machine=machine,
                                                 nodes=nodes))
        for line in picked.lines:
            talk(line)
        plan, chosen = picked.plan, picked.chosen
    else:
        steps = _steps(req, _load_data(opts, spec) if req.epochs is not None else None)
        plan = _plan_without_profile(req, ask, spec, workers)
    if plan is None or (torchrun is not None and (req.plan.planner_chooses
                                                  or ask.semantics is not None)):
        plan, chosen = share_plan(plan, opts.config.timeout_s, chosen)
    v = plan.virtual_stages
    config = opts.config if chosen is None else opts.config.chosen(*chosen)
    opts = dataclasses.replace(opts, config=dataclasses.replace(config, virtual_stages=v))
    layout = MicrobatchLayout(kind=opts.config.kind, minibatch_size=opts.minibatch_size,
                              microbatches=opts.config.per_minibatch, workers=workers)
    steps = _whole_rounds(req, layout, plan, steps, talk)
    if graph is not None and req.profile is None and graph.batch_size != layout.microbatch_size:
        # the schedule chosen cuts the minibatch otherwise: predict from its own microbatch
        talk(f"profiling again at the chosen microbatch of {layout.microbatch_size} samples")
        graph = _profile(req, spec, ask, machine, local=torchrun is None,
                         size=layout.microbatch_size)
    run = opts.with_plan(plan, steps)
    check_run(run, spec, run.workers)  # before anything is said of the plan
    memory: tuple[int, ...] = ()
    twice: tuple[int, ...] = ()
    predicted = 0.0
    if graph is not None:
        memory, twice = _memory(graph, plan, layout, steps, opts, step_bytes,
                                req.memory_bytes)
        predicted = predict_samples_per_s(graph, plan, layout, min(steps, 8) if v > 1 else steps,
                                          machine, nodes=nodes, zero=opts.config.zero,
                                          steps_agree=opts.config.runner_options().steps_agree,
                                          clips=opts.config.max_grad_norm is not None,
                                          step_factor=opts.step_factor(),
                                          prediction_factor=opts.prediction_factor(),
                                          vertical_sync=opts.config.vertical_sync)
        if req.memory_bytes is not None and plan.has_splits:
            for line in unfit_lines(memory_needs(graph, measured_topology(
                    graph, workers, machine, nodes=nodes), ask.optimizer)):
                talk(line)
    if plan.workers_used < workers:
        talk(f"the planner uses {plan.workers_used} of {workers} workers (faster than all)")
    talk(str(plan))
    if v > 1:
        p = plan.num_stages // v
        rule = (f"stage s and {2 * plan.workers_used - 1}-s on one worker"
                if plan.placement is Placement.V else f"stage s on worker s mod {workers}"
                if p == workers else f"stage s on position s mod {p}, replicated "
                + "-".join(str(st.replicas) for st in plan.stages[:p]))
        talk(f"{opts.config.schedule}: {v} stages per worker, {rule}")
    talk(f"predicted: {predicted:.1f} samples/s ({opts.config.schedule}, {steps} updates of "
         f"{opts.minibatch_size} samples)")
    return PlannedRun(run, spec, predicted, memory, twice)


def _plan_ask(req: TrainRequest, workers: int, step_bytes: StepBytes, *, local: bool
              ) -> PlanAsk:
    """What the job asks of its plan (a plan file is read later, on the ranks that need it),
    its optimizer's step temporaries ``step_bytes``; the ``dp`` schedule is one stage on
    every worker."""
    opts, source = req.run, req.plan
    config = source.config
    if opts.config.kind is ScheduleKind.DP and source.path is None and config is None:
        config = str(workers)
    v = opts.config.stages_per_rank  # a plan file's replaces it
    return PlanAsk(workers=workers, config=config, stages=source.stages, virtual_stages=v,
                   placement=opts.config.kind.placement if v > 1 else Placement.LOOP,
                   semantics=opts.config.chooses, minibatch_size=opts.minibatch_size,
                   # a saved profile is of the config's microbatch: the choice keeps it
                   microbatches=opts.config.microbatches if req.profile is None
                   else opts.config.per_minibatch,
                   memory_bytes=req.memory_bytes, allow_fewer_workers=local,
                   optimizer=planner_terms(dataclasses.replace(
                       opts.memory_choices(step=False), step_bytes=step_bytes)),
                   zero=opts.config.zero, steps_agree=opts.config.runner_options().steps_agree)


def _profile(req: TrainRequest, spec: ModelSpec, ask: PlanAsk, machine: LocalCalibration,
             *, local: bool, size: int | None = None) -> LayerGraph:
    """The saved profile, else one taken now as each worker computes (beside busy twins
    when the workers are local), of ``size`` samples (None: the config's microbatch)."""
    opts = req.run
    size = size or MicrobatchLayout(kind=opts.config.kind, minibatch_size=opts.minibatch_size,
                                    microbatches=opts.config.per_minibatch,
                                    workers=ask.workers).microbatch_size
    if req.profile is not None:
        return saved_profile(req.profile, spec, size, ref=opts.model,
                             model_kwargs=opts.model_kwargs)
    return profile_as_worker(spec, size, min_time_s=PROFILE_MIN_S,
                             twins=corun_twins(ask.workers, machine) if local else 0,
                             crowd=corun_crowd(ask.workers, machine) if local else 0,
                             ref=opts.model, model_kwargs=opts.model_kwargs,
                             precision=opts.config.number_formats)


def _plan_without_profile(req: TrainRequest, ask: PlanAsk, spec: ModelSpec,
                          workers: int) -> Plan | None:
    """A torchrun rank other than 0: the plan file or the forced stages, else None (rank 0
    shares the plan it chose)."""
    if req.plan.path is not None:
        return _load_plan(req.plan.path, spec, workers, fixed_world=True, req=req)
    forced = forced_partition(spec.num_layers, workers, ask.config, ask.stages)
    if forced is None or forced[0] is None:
        return None
    return Plan.from_config(spec.num_layers, forced[0], forced[1], model=spec.name)


def _memory(graph: LayerGraph, plan: Plan, layout: MicrobatchLayout, steps: int,
            opts: TrainOptions, step_bytes: StepBytes, limit: int | None
            ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each stage's predicted tensor bytes (what a rank's meter measures), the stage's
    whole need (the compute library's kernels too) checked against ``limit``; and per rank
    what the sum of its stages counts twice (:func:`~dreampipe.runtime.memory.counted_twice`)."""
    # long enough to fill the pipeline and the runtime's kept sends
    fill = max(plan.workers_used, plan.stages[0].replicas * plan.in_flight[0])
    horizon = min(steps, SENDS_KEPT + 2 * fill)
    schedule = layout.build([st.replicas for st in plan.stages], horizon, plan.in_flight,
                            virtual_stages=plan.virtual_stages,
                            zero=plan.zero_levels(opts.config.zero),
                            steps_agree=opts.config.runner_options().steps_agree)
    choices = dataclasses.replace(opts.memory_choices(step=False), step_bytes=step_bytes)
    check_memory(plan, predict_memory(graph, plan, schedule, choices), limit)
    return (predict_memory(graph, plan, schedule, choices, library=False),
            counted_twice(graph, plan, schedule, choices, library=False))


def _quiet(_line: str) -> None:
    """Say nothing: a torchrun rank other than 0."""


def _workers(req: TrainRequest, torchrun: tuple[int, int] | None) -> int:
    if torchrun is not None:
        world = torchrun[1]
        if req.workers is not None and req.workers != world:
            raise ConfigError(
                f"workers={req.workers} but torchrun started {world} processes; leave workers "
                "out or make them agree", "workers",
            )
        return world
    if req.workers is not None:
        return req.workers
    if req.plan.config:
        stages = len(req.plan.stages.split(",")) if req.plan.stages else None
        return sum(stages_from_config(req.plan.config, stages))
    return 2


def _check_before_profiling(
    req: TrainRequest, ask: PlanAsk, spec: ModelSpec, workers: int, fixed_world: bool
) -> tuple[int, Plan | None]:
    """Fail on a bad option, dataset, plan file or partition now, not after profiling.

    Loading the dataset is the check that it exists and fits the model (the
    workers load their own). Returns the number of steps and the plan from
    the plan file, if one was given.
    """
    check_options(req.run)
    opts = req.run
    MicrobatchLayout(kind=opts.config.kind, minibatch_size=opts.minibatch_size,
                     microbatches=opts.config.per_minibatch, workers=workers)  # checks them
    if req.run.seq_lengths is not None:
        check_token_model(spec, req.run.seq_lengths)
    steps = _steps(req, _load_data(req.run, spec))
    if req.plan.path is not None:
        return steps, _load_plan(req.plan.path, spec, workers, fixed_world, req)
    forced_partition(spec.num_layers, workers, ask.config, ask.stages)
    return steps, None


def _whole_rounds(
    req: TrainRequest, layout: MicrobatchLayout, plan: Plan, steps: int, talk: Say
) -> int:
    """``steps``, made whole rounds of PipeDream's all-reduce for replicated stages.

    Replicas of a stage take minibatches round-robin and all-reduce after
    each round, so the run must end on a round: steps from epochs or the
    default are rounded up, steps asked for exactly that are not a multiple
    are an error.
    """
    replicas = [st.replicas for st in plan.stages]
    whole = layout.whole_rounds(replicas, steps)
    if whole == steps:
        return steps
    rounds = math.lcm(*replicas)
    if req.exact_steps:
        raise ConfigError(
            f"steps={steps}: the plan {plan.config} all-reduces replicated stages every "
            f"{rounds} minibatches; use steps={whole}", "steps",
        )
    talk(f"{steps} steps rounded up to {whole}, whole all-reduce rounds of {rounds}")
    return whole


def _load_data(opts: TrainOptions, spec: ModelSpec) -> Dataset:
    return load_dataset(opts.dataset, spec, data_dir=opts.data_dir, seed=opts.config.seed)


def _steps(req: TrainRequest, data: Dataset | None) -> int:
    """The updates in ``req.epochs`` of ``data``, else ``req.run.steps``."""
    if req.epochs is None:
        return req.run.steps
    assert data is not None
    return steps_for_epochs(req.epochs, int(data.train_x.shape[0]), req.run.minibatch_size)


def _load_plan(path: str, spec: ModelSpec, workers: int, fixed_world: bool,
               req: TrainRequest) -> Plan:
    """The plan file, checked against the model, the workers and the schedule asked for
    (its stages per worker are its own: ``--virtual-stages`` may only repeat them)."""
    plan = Plan.load(Path(path))
    virtual_stages_of(plan, req.run.config.virtual_stages, f"plan {path!r}")
    check_schedule(plan, req.run.config.schedule, f"plan {path!r}")
    if plan.num_layers != spec.num_layers or (plan.model and plan.model != spec.name):
        raise PlanError(
            f"plan {path!r} is for {plan.model or 'a model'} with {plan.num_layers} "
            f"layers, not {spec.name} with {spec.num_layers}; plan this model with "
            "'dreampipe plan'"
        )
    if plan.workers_used > workers or (fixed_world and plan.workers_used != workers):
        raise ConfigError(
            f"plan {path!r} uses {plan.workers_used} workers but {workers} are "
            f"available; use workers={plan.workers_used}", "workers",
        )
    return plan

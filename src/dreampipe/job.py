"""A training job on the workers at hand: its plan and its predicted throughput.

``dreampipe train``, ``demo`` and ``bench`` all do the same three things
before they run anything: profile the model on this machine (one thread, as
each worker runs), plan it for the workers they have (or evaluate a
partition the user forced), and ask the simulator what throughput that plan
should reach, so the run can print predicted beside measured.

This machine is described as a flat topology: ``N`` workers, all joined by
gloo over the loopback interface at :data:`LOCAL_BANDWIDTH`. That figure is
what a 1 MB ``send``/``recv`` ping-pong between two local gloo processes
sustained on the project's 2-core machine (0.5 to 4 GB/s, noisy); for the
models dreampipe trains on a CPU, communication is a small part of the
time, so the figure matters little.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dreampipe.actions import ScheduleKind
from dreampipe.errors import PlanError
from dreampipe.graph import LayerGraph
from dreampipe.models import ModelSpec, get_model
from dreampipe.plan import Plan, stages_from_config
from dreampipe.topology import Topology

if TYPE_CHECKING:
    from dreampipe.runtime import RunResult

__all__ = [
    "LOCAL_BANDWIDTH",
    "TrainReport",
    "TrainRequest",
    "choose_plan",
    "local_topology",
    "model_spec",
    "parse_stage_bounds",
    "predict_samples_per_s",
    "profile_model",
    "run_train",
    "steps_for_epochs",
    "unit_size",
    "units_per_update",
]

log = logging.getLogger(__name__)

#: Bandwidth between two worker processes on one machine (gloo over loopback).
LOCAL_BANDWIDTH = "1GB/s"


def local_topology(workers: int) -> Topology:
    """This machine as ``workers`` workers on one level at :data:`LOCAL_BANDWIDTH`."""
    if workers < 1:
        raise PlanError(f"--workers {workers}: use at least 1 worker")
    return Topology.parse(str(workers), bandwidths=[LOCAL_BANDWIDTH])


def units_per_update(kind: ScheduleKind, microbatches: int, workers: int) -> int:
    """Scheduled units per weight update, as the runtime cuts them.

    One minibatch for PipeDream; ``microbatches`` for the pipelined
    synchronous schedules; ``microbatches`` per worker for data parallelism.
    """
    if kind is ScheduleKind.PIPEDREAM:
        return 1
    if kind is ScheduleKind.DP:
        return microbatches * workers
    return microbatches


def unit_size(kind: ScheduleKind, minibatch_size: int, microbatches: int, workers: int = 1) -> int:
    """Samples in one scheduled unit (see :func:`units_per_update`)."""
    per = units_per_update(kind, microbatches, workers)
    if minibatch_size % per:
        raise PlanError(
            f"--batch-size {minibatch_size} does not split into {per} equal units "
            f"({kind.value}, {microbatches} microbatches, {workers} workers); use a multiple "
            f"of {per}"
        )
    return minibatch_size // per


def profile_model(spec: ModelSpec, batch_size: int) -> LayerGraph:
    """Profile ``spec`` at ``batch_size`` with one thread, as each worker runs."""
    from dreampipe.profiler import profile_spec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return profile_spec(spec, batch_size=batch_size)
    finally:
        torch.set_num_threads(threads)


def parse_stage_bounds(text: str, num_layers: int) -> list[int]:
    """``"0,4"`` (the first layer of each stage) into ``[0, 4]``, checked against the model."""
    try:
        bounds = [int(x) for x in text.split(",")]
    except ValueError:
        raise PlanError(
            f"--stages {text!r}: list the first layer of each stage, e.g. 0,4"
        ) from None
    if bounds[0] != 0 or any(b <= a for a, b in itertools.pairwise(bounds)):
        raise PlanError(f"--stages {text!r} must start at 0 and increase, e.g. 0,4")
    if bounds[-1] >= num_layers:
        raise PlanError(
            f"--stages {text!r} starts a stage at layer {bounds[-1]} but the model has "
            f"{num_layers} layers (0..{num_layers - 1})"
        )
    return bounds


def choose_plan(
    graph: LayerGraph,
    workers: int,
    *,
    config: str | None = None,
    stages: str | None = None,
    allow_fewer_workers: bool = True,
) -> Plan:
    """The planner's best plan for ``workers`` local workers, or the forced partition.

    ``config`` (``"2-1"``) and ``stages`` (``"0,4"``) force a partition: one
    replica count and one first layer per stage; either alone is completed
    (``stages`` alone means one worker per stage, ``config`` alone needs a
    single stage).
    """
    from dreampipe import planner

    topology = local_topology(workers)
    if config is None and stages is None:
        return planner.plan(graph, topology, allow_fewer_workers=allow_fewer_workers)
    n = len(graph.layers)
    bounds = parse_stage_bounds(stages, n) if stages is not None else [0]
    replicas = stages_from_config(config, len(bounds)) if config else [1] * len(bounds)
    if len(replicas) != len(bounds):
        raise PlanError(
            f"--config {config!r} has {len(replicas)} stages but --stages "
            f"{stages or '0'!r} starts {len(bounds)}; give one first layer per stage"
        )
    if sum(replicas) != workers:
        raise PlanError(
            f"--config {config or 'straight'!r} needs {sum(replicas)} workers, not {workers}; "
            f"use --workers {sum(replicas)}"
        )
    return planner.evaluate(graph, topology, bounds, replicas)


def predict_samples_per_s(
    graph: LayerGraph,
    plan: Plan,
    kind: ScheduleKind,
    *,
    minibatch_size: int,
    microbatches: int,
    steps: int,
) -> float:
    """Samples/s the simulator predicts for ``steps`` updates of ``plan`` under ``kind``.

    ``graph`` must be profiled at :func:`unit_size` samples, so each
    scheduled unit costs what the profile measured.
    """
    from dreampipe.schedule import build_schedule
    from dreampipe.simulate import costs_from_profile, simulate

    unit = unit_size(kind, minibatch_size, microbatches, plan.workers_used)
    per_update = units_per_update(kind, microbatches, plan.workers_used)
    replicas = [st.replicas for st in plan.stages]
    schedule = build_schedule(replicas, kind, steps * per_update, units_per_update=per_update)
    topology = local_topology(plan.workers_used)
    fraction = unit / graph.batch_size if graph.batch_size else 1.0
    result = simulate(schedule, costs_from_profile(graph, plan, topology, unit_fraction=fraction))
    events = result.events
    span = max(e.end_s for e in events) - min(e.start_s for e in events) if events else 0.0
    if span <= 0:
        return 0.0
    return steps * minibatch_size / span


def steps_for_epochs(epochs: float, train_samples: int, minibatch_size: int) -> int:
    """Weight updates (PipeDream: minibatches) that cover ``epochs`` passes over the data."""
    if epochs <= 0:
        raise PlanError(f"--epochs {epochs}: use a positive number of epochs")
    return max(1, math.ceil(epochs * train_samples / minibatch_size))


def model_spec(name: str, model_kwargs: Sequence[tuple[str, Any]] = ()) -> ModelSpec:
    """The zoo model ``name`` sized by ``model_kwargs``; a bad size is a :class:`PlanError`."""
    try:
        return get_model(name, **dict(model_kwargs))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, PlanError):
            raise
        raise PlanError(f"model {name!r} with {dict(model_kwargs)}: {exc}") from None


@dataclass(frozen=True)
class TrainRequest:
    """What ``dreampipe train`` was asked to do (see its ``--help``).

    ``workers`` None means: the forced config's total, else 2. ``steps`` and
    ``epochs`` both None means 10 steps.
    """

    model: str
    model_kwargs: tuple[tuple[str, Any], ...] = ()
    workers: int | None = None
    plan_path: str | None = None
    config: str | None = None
    stages: str | None = None
    schedule: ScheduleKind = ScheduleKind.PIPEDREAM
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    minibatch_size: int = 32
    microbatches: int = 1
    steps: int | None = None
    epochs: float | None = None
    seed: int = 0
    dataset: str = "synthetic"
    data_dir: str | None = None
    vertical_sync: bool = False
    stash: bool = True
    timeout_s: float = 60.0
    record_events: bool = False
    progress: bool = True


@dataclass(frozen=True)
class TrainReport:
    """The plan that ran, its predicted throughput and what the run measured."""

    plan: Plan
    steps: int
    predicted_samples_per_s: float
    result: RunResult

    def summary(self) -> dict[str, Any]:
        """The ``--json`` object."""
        res = self.result
        out: dict[str, Any] = {
            "samples_per_s": res.samples_per_s,
            "predicted_samples_per_s": self.predicted_samples_per_s,
            "final_loss": res.final_loss,
            "losses": list(res.losses),
            "elapsed_s": res.elapsed_s,
            "steps": self.steps,
            "config": self.plan.config,
            "stages": [[st.first, st.last, st.replicas] for st in self.plan.stages],
        }
        if res.accuracy is not None:
            out["accuracy"] = res.accuracy
        return out


Say = Callable[[str], None]


def run_train(
    req: TrainRequest, *, torchrun: tuple[int, int] | None = None, say: Say | None = None
) -> TrainReport | None:
    """Profile, plan, predict and train; the report (None on torchrun ranks other than 0).

    ``torchrun`` is ``(rank, world_size)`` when the processes were started by
    torchrun; otherwise dreampipe starts the local workers itself. ``say``
    receives the human-readable lines (plan, prediction) on the reporting rank.
    """
    spec = model_spec(req.model, req.model_kwargs)
    workers = _workers(req, torchrun)
    steps = _steps(req, spec)
    if req.schedule is ScheduleKind.DP and req.plan_path is None and req.config is None:
        req = replace(req, config=str(workers), stages=None)
    unit = unit_size(req.schedule, req.minibatch_size, req.microbatches,
                     workers if req.schedule is ScheduleKind.DP else 1)
    talk = say if say is not None and (torchrun is None or torchrun[0] == 0) else _quiet
    graph = profile_model(spec, unit)
    plan = _plan(req, spec, graph, workers, fixed_world=torchrun is not None)
    if plan.workers_used < workers:
        talk(f"the planner uses {plan.workers_used} of {workers} workers (faster than all)")
    predicted = predict_samples_per_s(
        graph, plan, req.schedule, minibatch_size=req.minibatch_size,
        microbatches=req.microbatches, steps=steps,
    )
    talk(str(plan))
    talk(f"predicted: {predicted:.1f} samples/s ({req.schedule.value}, {steps} updates of "
         f"{req.minibatch_size} samples)")
    from dreampipe.runtime import OptimizerKind, RunConfig, launch_local, run_from_env

    cfg = RunConfig(
        model=req.model, plan=plan, schedule=req.schedule, minibatch_size=req.minibatch_size,
        microbatches=req.microbatches, steps=steps, optimizer=OptimizerKind(req.optimizer),
        lr=req.lr, momentum=req.momentum, seed=req.seed, stash=req.stash,
        vertical_sync=req.vertical_sync, timeout_s=req.timeout_s, dataset=req.dataset,
        data_dir=req.data_dir, model_kwargs=req.model_kwargs, record_events=req.record_events,
        progress=req.progress,
    )
    result = run_from_env(cfg) if torchrun else launch_local(cfg, workers=plan.workers_used)
    if result is None:
        return None
    return TrainReport(plan, steps, predicted, result)


def _quiet(_line: str) -> None:
    """Say nothing: a torchrun rank other than 0."""


def _workers(req: TrainRequest, torchrun: tuple[int, int] | None) -> int:
    if torchrun is not None:
        world = torchrun[1]
        if req.workers is not None and req.workers != world:
            raise PlanError(
                f"--workers {req.workers} but torchrun started {world} processes; drop "
                "--workers or make them agree"
            )
        return world
    if req.workers is not None:
        return req.workers
    if req.config:
        stages = len(req.stages.split(",")) if req.stages else None
        return sum(stages_from_config(req.config, stages))
    return 2


def _steps(req: TrainRequest, spec: ModelSpec) -> int:
    if req.steps is not None:
        return req.steps
    if req.epochs is None:
        return 10
    from dreampipe.data import load_dataset

    data = load_dataset(req.dataset, spec, data_dir=req.data_dir, seed=req.seed)
    return steps_for_epochs(req.epochs, data.train_x.shape[0], req.minibatch_size)


def _plan(req: TrainRequest, spec: ModelSpec, graph: LayerGraph, workers: int,
          fixed_world: bool) -> Plan:
    if req.plan_path is None:
        return choose_plan(graph, workers, config=req.config, stages=req.stages,
                           allow_fewer_workers=not fixed_world)
    plan = Plan.load(Path(req.plan_path))
    if plan.num_layers != spec.num_layers or (plan.model and plan.model != spec.name):
        raise PlanError(
            f"plan {req.plan_path!r} is for {plan.model or 'a model'} with {plan.num_layers} "
            f"layers, not {spec.name} with {spec.num_layers}; plan this model with "
            "'dreampipe plan'"
        )
    if plan.workers_used > workers or (fixed_world and plan.workers_used != workers):
        raise PlanError(
            f"plan {req.plan_path!r} uses {plan.workers_used} workers but {workers} are "
            f"available; use --workers {plan.workers_used}"
        )
    return plan

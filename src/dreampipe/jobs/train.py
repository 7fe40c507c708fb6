"""``dreampipe train``'s job: plan, predict and run, locally or under torchrun.

Locally, dreampipe profiles the model, plans it for the workers asked for,
and starts those worker processes itself. Under ``torchrun`` the processes
already exist, one per rank, and every rank must run the *same* plan; but a
profile is a measurement and differs a little from rank to rank. So only
rank 0 profiles and plans; when the planner chose the plan, rank 0 publishes
it in torchrun's own rendezvous store (the agent's TCP store at
``MASTER_ADDR:MASTER_PORT``) and the other ranks read it from there. A plan
file or a forced ``--config``/``--stages`` partition needs no exchange.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreampipe.errors import PeerTimeoutError, PlanError
from dreampipe.jobs.local import (
    choose_plan,
    forced_partition,
    model_spec,
    predict_samples_per_s,
    profile_model,
    steps_for_epochs,
    unit_size,
)
from dreampipe.models import ModelSpec
from dreampipe.planning.plan import Plan, stages_from_config
from dreampipe.profiling.graph import LayerGraph
from dreampipe.scheduling.actions import ScheduleKind

if TYPE_CHECKING:
    from dreampipe.runtime import RunResult
    from dreampipe.runtime.data import Dataset

__all__ = ["TrainReport", "TrainRequest", "run_train", "share_plan", "torchrun_world"]

log = logging.getLogger(__name__)

Say = Callable[[str], None]


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


def torchrun_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` when started by torchrun (or any env:// launcher), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def share_plan(plan: Plan | None, timeout_s: float) -> Plan:
    """Rank 0 passes its ``plan``; every other rank passes None and gets rank 0's.

    Uses the torchrun agent's store; other launchers need a plan every rank
    can compute alone (``--plan`` or ``--config``/``--stages``).
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise PlanError(
            "this launcher has no torchrun agent store to share rank 0's plan through; "
            "give every rank the same plan with --plan FILE or --config/--stages"
        )
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    key = (f"dreampipe/plan/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if plan is not None:
        store.set(key, plan.to_json())
        return plan
    try:
        return Plan.from_dict(json.loads(store.get(key)))
    except RuntimeError as exc:
        raise PeerTimeoutError(
            f"rank {os.environ.get('RANK')} waited {timeout_s:g} s for rank 0's plan ({exc}); "
            "check rank 0's output, or raise --timeout"
        ) from exc


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
    if req.schedule is ScheduleKind.DP and req.plan_path is None and req.config is None:
        req = replace(req, config=str(workers), stages=None)
    unit = unit_size(req.schedule, req.minibatch_size, req.microbatches,
                     workers if req.schedule is ScheduleKind.DP else 1)
    lead = torchrun is None or torchrun[0] == 0
    talk = say if say is not None and lead else _quiet
    plan: Plan | None = None
    graph: LayerGraph | None = None
    if lead:
        steps, given = _check_before_profiling(req, spec, workers, fixed_world=torchrun is not None)
        graph = profile_model(spec, unit)
        plan = given or choose_plan(graph, workers, config=req.config, stages=req.stages,
                                    allow_fewer_workers=torchrun is None)
    else:
        steps = _steps(req, _load_data(req, spec) if req.epochs is not None else None)
        if req.plan_path is not None:
            plan = _load_plan(req, spec, workers, fixed_world=True)
        else:
            forced = forced_partition(spec.num_layers, workers, req.config, req.stages)
            if forced is not None:
                plan = Plan.from_config(spec.num_layers, *forced, model=spec.name)
    if plan is None or (torchrun is not None and _planner_chose(req)):
        plan = share_plan(plan, req.timeout_s)
    steps = _whole_rounds(req, plan, steps, talk)
    predicted = 0.0 if graph is None else predict_samples_per_s(
        graph, plan, req.schedule, minibatch_size=req.minibatch_size,
        microbatches=req.microbatches, steps=steps,
    )
    if plan.workers_used < workers:
        talk(f"the planner uses {plan.workers_used} of {workers} workers (faster than all)")
    talk(str(plan))
    talk(f"predicted: {predicted:.1f} samples/s ({req.schedule.value}, {steps} updates of "
         f"{req.minibatch_size} samples)")
    result = _run(req, plan, steps, torchrun is not None)
    if result is None:
        return None
    return TrainReport(plan, steps, predicted, result)


def _run(req: TrainRequest, plan: Plan, steps: int, under_torchrun: bool) -> RunResult | None:
    from dreampipe.runtime import OptimizerKind, RunConfig, launch_local, run_from_env

    cfg = RunConfig(
        model=req.model, plan=plan, schedule=req.schedule, minibatch_size=req.minibatch_size,
        microbatches=req.microbatches, steps=steps, optimizer=OptimizerKind(req.optimizer),
        lr=req.lr, momentum=req.momentum, seed=req.seed, stash=req.stash,
        vertical_sync=req.vertical_sync, timeout_s=req.timeout_s, dataset=req.dataset,
        data_dir=req.data_dir, model_kwargs=req.model_kwargs, record_events=req.record_events,
        progress=req.progress,
    )
    return run_from_env(cfg) if under_torchrun else launch_local(cfg, workers=plan.workers_used)


def _planner_chose(req: TrainRequest) -> bool:
    return req.plan_path is None and req.config is None and req.stages is None


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


def _check_before_profiling(
    req: TrainRequest, spec: ModelSpec, workers: int, fixed_world: bool
) -> tuple[int, Plan | None]:
    """Fail on a bad option, dataset, plan file or partition now, not after profiling.

    Loading the dataset is the check that it exists and fits the model (the
    workers load their own). Returns the number of steps and the plan from
    ``--plan``, if one was given.
    """
    from dreampipe.runtime.checks import check_options

    check_options(req.schedule, microbatches=req.microbatches,
                  vertical_sync=req.vertical_sync, stash=req.stash, lr=req.lr)
    steps = _steps(req, _load_data(req, spec))
    if req.plan_path is not None:
        return steps, _load_plan(req, spec, workers, fixed_world)
    forced_partition(spec.num_layers, workers, req.config, req.stages)
    return steps, None


def _whole_rounds(req: TrainRequest, plan: Plan, steps: int, talk: Say) -> int:
    """``steps``, made whole rounds of PipeDream's all-reduce for replicated stages.

    Replicas of a stage take minibatches round-robin and all-reduce after
    each round, so the run must end on a round: steps from ``--epochs`` are
    rounded up, an explicit ``--steps`` that is not a multiple is an error.
    """
    if req.schedule is not ScheduleKind.PIPEDREAM:
        return steps
    from dreampipe.scheduling.build import whole_rounds

    replicas = [st.replicas for st in plan.stages]
    rounds = math.lcm(*replicas)
    whole = whole_rounds(replicas, steps)
    if whole == steps:
        return steps
    if req.steps is not None:
        raise PlanError(
            f"--steps {steps}: the plan {plan.config} all-reduces replicated stages every "
            f"{rounds} minibatches; use --steps {whole}"
        )
    talk(f"{steps} steps rounded up to {whole}, whole all-reduce rounds of {rounds}")
    return whole


def _load_data(req: TrainRequest, spec: ModelSpec) -> Dataset:
    from dreampipe.runtime.data import load_dataset

    return load_dataset(req.dataset, spec, data_dir=req.data_dir, seed=req.seed)


def _steps(req: TrainRequest, data: Dataset | None) -> int:
    """``req.steps``, else the updates in ``req.epochs`` of ``data``, else 10."""
    if req.steps is not None:
        return req.steps
    if req.epochs is None:
        return 10
    assert data is not None
    return steps_for_epochs(req.epochs, int(data.train_x.shape[0]), req.minibatch_size)


def _load_plan(req: TrainRequest, spec: ModelSpec, workers: int, fixed_world: bool) -> Plan:
    plan = Plan.load(Path(str(req.plan_path)))
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

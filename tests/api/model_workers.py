"""Rank functions that train the model zoo of :mod:`.model_zoo` through the Pipeline."""

from __future__ import annotations

import gc
import threading
from functools import cache
from typing import Any

import torch

from dreampipe.api import Pipeline, TrainConfig
from dreampipe.api.group import init_process_group
from dreampipe.planning.plan import Plan
from dreampipe.runtime.overlap import OverlappedPair
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.splitter.chain import split_layers

from .model_zoo import CaseSpec, find_case

__all__ = ["train_case", "train_cases"]


def train_cases(rank: int, world: int, jobs: list[dict[str, Any]]) -> list[Any] | None:
    """:func:`train_case` for every job, one after the other, in one process group."""
    init_process_group(timeout_s=60.0)
    try:
        return [train_case(rank, world, job) for job in jobs]
    finally:
        torch.distributed.destroy_process_group()


def _where(job: dict[str, Any], world: int) -> dict[str, Any]:
    """The job's plan: ``plan``, one stage on every worker (``replicated``), or its split
    points (the case's unless the job gives them)."""
    if "plan" in job:
        return {"plan": job["plan"]}
    if "copies" in job:  # each stage's replicas (one count: all), 2 a rank, at split points
        names = _layer_names(job["case"])
        bounds = [0] + [names.index(point) for point in job["split_points"]]
        copies = job["copies"]
        replicas = copies if isinstance(copies, list) else [copies] * len(bounds)
        return {"plan": Plan.from_config(len(names), bounds, replicas,
                                         layer_names=tuple(names),
                                         virtual_stages=job["virtual_stages"],
                                         placement=ScheduleKind(job["schedule"]).placement)}
    if "config" in job:  # replicas per stage, e.g. "2-1", cut at the case's split point
        names = _layer_names(job["case"])
        cut = names.index(find_case(job["case"]).split_points[0])
        return {"plan": Plan.from_config(len(names), [0, cut],
                                         [int(r) for r in job["config"].split("-")])}
    if job.get("replicated"):
        case = find_case(job["case"])
        layers = len(split_layers(case.build(), case.example(0, 1)[0]))
        return {"plan": Plan.from_config(layers, [0], [world])}
    return {"plan": job.get("split_points", find_case(job["case"]).split_points)}


@cache
def _layer_names(name: str) -> list[str]:
    """Case ``name``'s layers, by name (traced once a process)."""
    case = find_case(name)
    return [layer for layer, _ in split_layers(case.build(), case.example(0, 1)[0])]


class _AtOnce:
    """An overlap hook that runs each pair's backward on a thread of its own while its
    forward runs, as a model overlapping its communication would; counts the pairs."""

    def __init__(self) -> None:
        self.pairs = 0

    def __call__(self, pair: OverlappedPair) -> None:
        self.pairs += 1
        failed: list[BaseException] = []

        def backward() -> None:
            try:
                pair.run_backward()
            except BaseException as exc:  # raised again on the caller's thread
                failed.append(exc)

        thread = threading.Thread(target=backward)
        thread.start()
        pair.run_forward()
        thread.join()
        if failed:
            raise failed[0]


def _optimizer(name: str, lr: float, momentum: float) -> Any:
    """The job's optimizer factory: ``sgd`` (with ``momentum``), ``adam``, or ``adamw``
    (weight decay 0.1)."""
    return {"adam": lambda p: torch.optim.Adam(p, lr=lr),
            "adamw": lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.1),
            "sgd": lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum)}[name]


def train_case(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any] | None:
    """Train case ``job["case"]`` (built on meta if ``job["meta"]``, resumed from the
    checkpoint directory ``job["resume"]`` if given) split at its split points (or
    ``job["plan"]``, ``job["split_points"]``, ``job["config"]``'s replicas of two stages,
    one replicated stage, or ``job["copies"]`` replicas of every stage at its split points,
    or that list of each stage's)
    in ``precision`` (with ``loss_scale``) and ``virtual_stages`` (``variable_dims`` declared),
    clipped by ``max_grad_norm`` if given,
    with ``optimizer`` ``"sgd"`` (default), ``"adam"`` or ``"adamw"``, for ``steps`` minibatches of
    ``minibatch``
    (repeating every ``job["cycle"]`` if given), then save a checkpoint in ``job["save"]``
    if given, and evaluate ``job["evaluate"]`` held-out minibatches; rank 0 returns the
    losses, the full state, the plan's stage bounds and replicas, whether rank 0's stage
    recomputes, the schedule it ran, the checkpoint's path, the held-out loss, the
    skipped minibatches, whether each rank's stage shards over its replicas (``zero``) and,
    with ``job["measure"]``, each rank's stage and measured and predicted peak bytes."""
    case = find_case(job["case"])
    spec = CaseSpec(case, job["seed"])
    lr, momentum = job["lr"], job.get("momentum", 0.0)
    hook = _AtOnce()
    if job.get("meta"):
        with torch.device("meta"):
            model = case.build()
    else:
        model = spec.model()
    if job.get("at_once"):
        model.overlap_pair = hook  # the model's own hook
    pipe = Pipeline(
        model, example=case.example(0, job["minibatch"]), loss_fn=case.loss_fn,
        optimizer=_optimizer(job.get("optimizer", "sgd"), lr, momentum),
        config=TrainConfig(
            schedule=job["schedule"], microbatches=job.get("microbatches", 1), timeout_s=30.0,
            resume=job.get("resume"), semantics=job.get("semantics", "sync"),
            precision=job.get("precision", "fp32"),
            recompute_blocks=job.get("recompute_blocks", 0), zero=job.get("zero", 0),
            max_grad_norm=job.get("max_grad_norm"),
            **({"loss_scale": job["loss_scale"]} if "loss_scale" in job else {}),
            virtual_stages=job.get("virtual_stages", 1),
            variable_dims=tuple(job.get("variable_dims", ())),
            measure_memory=job.get("measure", False)), **_where(job, world),
    )
    cycle = job.get("cycle", 1 << 30)  # minibatches k and k + cycle are the same
    for k in range(pipe.minibatches, pipe.minibatches + job["steps"]):
        pipe.step(*case.example(k % cycle, job["minibatch"]))
    losses = pipe.finish()
    memory: list[Any] = [None] * world  # each rank's (stage, measured, predicted) bytes
    if job.get("measure"):  # the peak of training, before the state is gathered
        report = pipe.memory()
        torch.distributed.all_gather_object(
            memory, (report.stage, report.measured, report.predicted))
    held_out = [case.example(100 + j, job["minibatch"]) for j in range(job.get("evaluate", 0))]
    evaluated = pipe.evaluate(held_out).loss if held_out else None
    saved = str(pipe.save(job["save"])) if "save" in job else None
    state = pipe.full_state_dict()
    bounds = [st.first for st in pipe.plan.stages]
    replicas = [st.replicas for st in pipe.plan.stages]
    recomputes = pipe.module.recompute or len(pipe.module.recomputed)
    skipped = pipe.skipped
    sharded: list[bool] = [False] * world  # each rank's: does its stage shard?
    torch.distributed.all_gather_object(sharded, pipe.module.zero is not None)
    pipe.close()
    # A process runs many jobs (models_script.py, train_cases): close's full collection
    # would walk every object the earlier jobs left alive (torch's and transformers' lazy
    # imports, trace caches), about 0.4 s a job, as long as a small job trains. Its
    # survivors go out of the collector's reach (as prepare_process does at start).
    gc.freeze()
    out = {"losses": losses, "state": state, "bounds": bounds, "replicas": replicas,
           "saved": saved, "evaluated": evaluated, "recomputes": recomputes,
           "schedule": pipe.kind.value, "skipped": skipped, "sharded": sharded,
           "memory": memory, "overlapped": hook.pairs}
    return out if rank == 0 else None

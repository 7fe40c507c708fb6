"""``dreampipe train``'s run: a zoo model on a built-in dataset, one Pipeline per rank.

:func:`~dreampipe.commands.train_plan.plan_train` checks, profiles, plans and
predicts; then every rank (local processes that :func:`train_local` starts
with the runtime's launcher, or torchrun's, each calling :func:`train_rank`)
builds its stage of the model (the other layers on the meta device), feeds
the Pipeline the dataset's minibatches in order and saves a checkpoint
every ``every`` minibatches. ``--steps`` is the total:
a resumed run continues from the checkpoint's data position to it.

``resume`` means "continue from the newest committed checkpoint in the
folder if there is one, else start at minibatch 0", so one command serves
a first start and every ``torchrun --max-restarts`` restart (and an
elastic restart on fewer processes, which re-plans for its world: the plan
that saved is in the checkpoint, and the run says both). Saves that never
committed are removed. With a data log, rank 0 appends each minibatch it
trains (:mod:`.datalog`), so a restarted run can be audited.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dreampipe.api.config import TrainConfig
from dreampipe.api.datalog import DataLog
from dreampipe.api.memory_report import counting
from dreampipe.api.pipeline import Pipeline
from dreampipe.commands.seq_lengths import cut, length_times, step_length
from dreampipe.commands.train_config import TrainResult, TrainRun, check_run
from dreampipe.commands.train_plan import Say, TrainRequest, plan_train
from dreampipe.commands.train_resume import check_folder, nothing_left, resume_point, tidy
from dreampipe.errors import ConfigError, WorkerError
from dreampipe.models.datasets import load_dataset
from dreampipe.models.resolve import resolve_spec
from dreampipe.planning.plan import Plan
from dreampipe.runtime.backend import backend_for_node, barrier
from dreampipe.runtime.memory_meter import MemoryUse, Meter, start_measuring
from dreampipe.runtime.processes import prepare_process, run_processes
from dreampipe.runtime.results import RankReport, gather_on_first, sorted_events, stage_states

__all__ = ["Checkpoints", "TrainJob", "TrainReport", "run_train", "train_local", "train_rank"]

_log = logging.getLogger(__name__)
_EVAL_BATCH = 256


@dataclass(frozen=True)
class TrainReport:
    """The plan that ran, its predicted throughput and memory, and what the run measured.

    ``predicted_memory`` holds the bytes each stage's workers are predicted
    to add to their baseline (:func:`~dreampipe.runtime.memory.predict_memory`).
    """

    plan: Plan
    steps: int
    predicted_samples_per_s: float
    result: TrainResult
    predicted_memory: tuple[int, ...] = ()
    #: The config that ran (with the schedule ``--schedule auto`` chose).
    config: TrainConfig = TrainConfig()
    #: Per rank, what the sum of its stages' predictions counts twice (several stages).
    counted_twice: tuple[int, ...] = ()

    def memory_rows(self) -> list[dict[str, Any]]:
        """Per rank: stage, predicted and measured bytes (peak less baseline), their ratio."""
        rows = []
        for m in self.result.memory:
            predicted = sum(self.predicted_memory[s] for s in self._stages_of(m)) - (
                self._twice(m)) if self.predicted_memory else None
            rows.append({
                "rank": m.rank, "stage": m.stage, "device": m.kind,
                "predicted_bytes": predicted, "measured_bytes": m.used,
                "baseline_bytes": m.baseline, "peak_bytes": m.peak,
                "ratio": m.used / predicted if predicted else None,
            })
        return rows

    def _twice(self, m: MemoryUse) -> int:
        """What the sum of rank ``m.rank``'s stages counts twice: only a rank of several
        stages has any, and then no stage is split (a rank is the schedule's)."""
        several = self.plan.virtual_stages > 1 and self.counted_twice
        return self.counted_twice[m.rank] if several else 0

    def _stages_of(self, m: MemoryUse) -> list[int]:
        """The stages rank ``m.rank`` runs: its one, or an interleaved rank's several."""
        if self.plan.virtual_stages == 1:
            return [m.stage]
        return [s for s, st in enumerate(self.plan.stages) if m.rank in st.ranks]

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
            "steps_trained": len(res.losses),
            "schedule": self.config.schedule,
            "microbatches": self.config.per_minibatch,
            "partition": self.plan.config,
            "topology": self.plan.topology,
            "virtual_stages": self.plan.virtual_stages,
            "stages": [[st.first, st.last, st.replicas] for st in self.plan.stages],
            "memory": self.memory_rows(),
            "config": self.config.to_dict(),
        }
        if res.accuracy is not None:
            out["accuracy"] = res.accuracy
        if res.lengths:
            out["seq_lengths"] = length_times(res.lengths, res.step_s)
        return out


@dataclass(frozen=True)
class Checkpoints:
    """Where and how often a train job saves, whether it resumes from there (if it can),
    and the data log it appends to (see the module docstring)."""

    directory: Path | None = None
    every: int | None = None
    resume: bool = False
    data_log: Path | None = None

    def __post_init__(self) -> None:
        if (self.every is not None or self.resume) and self.directory is None:
            asked = "resume" if self.resume else "checkpoint_every"
            given = "resume=True" if self.resume else f"checkpoint_every={self.every}"
            raise ConfigError(f"{given} needs checkpoint_dir=DIR, the folder checkpoints are "
                              "saved in and resumed from", asked, "checkpoint_dir")
        if self.every is not None and self.every < 1:
            raise ConfigError(f"checkpoint_every={self.every}; use 1 or more",
                              "checkpoint_every")


@dataclass(frozen=True)
class TrainJob:
    """What every rank trains: the run, where it saves, and the checkpoint it resumes from."""

    run: TrainRun
    checkpoints: Checkpoints = Checkpoints()
    resume_from: Path | None = None


def run_train(
    req: TrainRequest, *, torchrun: tuple[int, int] | None = None, say: Say | None = None,
    checkpoints: Checkpoints | None = None,
) -> TrainReport | None:
    """Plan, then train; the report (None on torchrun ranks other than 0)."""
    ckpt = checkpoints or Checkpoints()
    folder, resume = ckpt.directory, ckpt.resume
    lead = torchrun is None or torchrun[0] == 0
    check_folder(folder, resume, req.run, lead=lead)
    if req.epochs is None and nothing_left(  # before profiling
            resume_point(folder, resume, req.run.steps), req.run.steps, say):
        return None
    planned = plan_train(req, torchrun=torchrun, say=say)
    run = planned.run
    found = resume_point(folder, resume, run.steps)
    if nothing_left(found, run.steps, say):
        return None
    if lead:
        tidy(folder, found, resume, run.plan, say)
    job = TrainJob(run, ckpt, found)
    result = train_rank(*torchrun, job) if torchrun is not None else train_local(job)
    if result is None:
        return None
    return TrainReport(run.plan, run.steps, planned.predicted_samples_per_s, result,
                       planned.predicted_memory, run.config, planned.counted_twice)


def train_local(job: TrainJob, *, deadline_s: float | None = None) -> TrainResult:
    """Train ``job`` on the plan's workers, local processes; rank 0's result.

    The run is checked here first, so a bad one fails before any process
    starts. ``deadline_s`` bounds the whole run (None: only each wait's
    ``timeout_s``). A failing rank's error is raised here, as its own
    DreampipeError class when it is one, with every failed rank's traceback.
    """
    run = job.run
    check_run(run, resolve_spec(run.model, run.model_kwargs))

    def where(rank: int) -> str:
        return f"stage {run.plan.stage_of_rank(rank)}"

    results = run_processes(train_rank, run.workers, job, deadline_s=deadline_s,
                            threads=backend_for_node(run.workers).threads, where=where)
    if not isinstance(results[0], TrainResult):
        raise WorkerError("rank 0 finished without a result")
    return results[0]


def train_rank(rank: int, world: int, job: TrainJob) -> TrainResult | None:
    """One rank of ``job`` (a local process's or torchrun's): build its stage, train to
    ``run.steps`` minibatches, report to rank 0; the result on rank 0."""
    run = job.run
    spec = resolve_spec(run.model, run.model_kwargs)
    split = run.plan.has_splits
    data = load_dataset(run.dataset, spec, data_dir=run.data_dir, seed=run.config.seed)
    prepare_process()
    meter = start_measuring() if run.measure_memory else None  # before the layers exist
    with counting(meter):
        if split:  # the Pipeline builds each worker's share only
            with torch.device("meta"):
                model = spec.build(seed=run.config.seed)
        else:  # the rank's stages only (far apart under interleaving)
            model = spec.build_only(run.plan.layers_of_rank(rank), run.config.seed)
        config = dataclasses.replace(run.config, virtual_stages=run.plan.virtual_stages,
                                     resume=job.resume_from)
        pipe = Pipeline(model, example=data.batch(0, run.minibatch_size), loss_fn=spec.loss_fn,
                        optimizer=run.optimizer_factory(), plan=run.plan, config=config)
        result = _train(pipe, job, data, rank, world, meter)  # on an error the launcher ends all
    pipe.close()
    return result


def _train(pipe: Pipeline, job: TrainJob, data: Any, rank: int, world: int,
           meter: Meter | None) -> TrainResult | None:
    run, ckpt = job.run, job.checkpoints
    start = pipe.minibatches
    bar = _progress(run, rank, world, start)
    log = None
    if ckpt.data_log is not None and rank == 0:
        log = DataLog(ckpt.data_log, start=start, steps=run.steps, plan=run.plan.config,
                      workers=world)
    if run.steps > start:
        pipe.reserve(run.steps - start)  # no pause to extend the schedule while timed
    barrier(max(run.config.timeout_s, 60.0))
    lengths = [] if run.seq_lengths is None else [
        step_length(run.config.seed, k, run.seq_lengths) for k in range(start, run.steps)]
    step_s: list[float] = []
    t0 = pipe.start_clock()
    for k in range(start, run.steps):
        batch = data.batch(k, run.minibatch_size)
        if lengths:
            batch = cut(batch, lengths[k - start])
        began = time.perf_counter()
        pipe.step(*batch)
        step_s.append(time.perf_counter() - began)
        if log is not None:
            log.record(k, *batch)
        if ckpt.every is not None and ckpt.directory is not None and (k + 1) % ckpt.every == 0:
            pipe.save(ckpt.directory)
        if bar is not None:
            bar.update(1)
    if log is not None:
        log.close()
    losses = pipe.finish()
    loop_s = time.perf_counter() - t0
    memory = None if meter is None else meter.finish(rank, pipe.module.stage)
    if bar is not None:
        bar.close()
    accuracy = None
    if run.evaluate and data.has_test:
        n = len(data.test_y)
        batches = [(data.test_x[i : i + _EVAL_BATCH], data.test_y[i : i + _EVAL_BATCH])
                   for i in range(0, n, _EVAL_BATCH)]
        accuracy = pipe.evaluate(batches).accuracy
    replica = pipe.runner.schedule.replica_of_rank(pipe.srank)
    gather = replica == 0 or pipe.runner.gathers_state  # ZeRO's masters: every replica
    states = pipe.runner.final_states() if gather else {}
    states = states if replica == 0 else {}
    mine = [RankReport(rank=rank, stage=m.stage, replica=replica, loop_s=loop_s,
                       events=pipe.events if k == 0 else [], state=states.get(m.stage),
                       memory=memory if k == 0 else None)
            for k, m in enumerate(pipe.runner.modules)]  # one per stage of the rank
    gathered = gather_on_first(mine)
    if gathered is None:
        return None
    reports = [r for rs in gathered for r in rs if isinstance(r, RankReport)]
    elapsed = max(r.loop_s for r in reports)
    return TrainResult(
        samples_per_s=(run.steps - start) * run.minibatch_size / elapsed if elapsed else 0.0,
        final_loss=losses[-1], losses=tuple(losses), accuracy=accuracy,
        events=sorted_events(reports), elapsed_s=elapsed,
        stage_states=tuple(stage_states(reports, run.plan.num_stages)),
        memory=tuple(r.memory for r in reports if r.memory is not None),
        lengths=tuple(lengths), step_s=tuple(step_s),
    )


def _progress(run: TrainRun, rank: int, world: int, start: int) -> Any:
    """A progress bar on the last rank, counting minibatches."""
    if not run.progress or rank != world - 1:
        return None
    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing semaphore, which the rank leaves behind
    # ("leaked semaphore objects" at exit); one bar per process needs a thread lock only
    tqdm.set_lock(threading.RLock())
    return tqdm(total=run.steps, initial=start, unit="minibatch", file=sys.stderr,
                dynamic_ncols=True)

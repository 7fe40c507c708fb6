"""Start ranks: locally with :func:`launch_local`, or under torchrun with :func:`run_from_env`.

Both run :func:`run_rank` on an initialised process group; ``launch_local``
checks a run in the parent, then trains it on local processes that
:func:`~dreampipe.runtime.processes.run_processes` starts and supervises.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dreampipe.errors import ConfigError, DreampipeError, WorkerError
from dreampipe.models.resolve import resolve_spec
from dreampipe.models.spec import ModelSpec
from dreampipe.runtime.checks import check_config, check_stage_outputs
from dreampipe.runtime.comm import process_groups
from dreampipe.runtime.config import RunConfig, RunResult
from dreampipe.runtime.data import load_dataset
from dreampipe.runtime.engine import RankRunner, barrier
from dreampipe.runtime.fused import LinearGradients
from dreampipe.runtime.processes import prepare_process, run_processes
from dreampipe.runtime.results import RankReport, assemble
from dreampipe.runtime.stage import StageModule

__all__ = ["launch_local", "run_from_env", "run_rank"]

_log = logging.getLogger(__name__)
_MIN_SETUP_S = 60.0


def run_rank(
    cfg: RunConfig, rank: int, world: int, device: torch.device, *, spec: ModelSpec
) -> RunResult | None:
    """Train as ``rank`` of an initialised process group; the result on rank 0.

    ``spec`` is ``cfg.model`` resolved, and ``cfg`` already checked against it.
    """
    schedule = cfg.layout.build([st.replicas for st in cfg.plan.stages], cfg.steps,
                                cfg.plan.in_flight)
    links, groups = process_groups([st.ranks for st in cfg.plan.stages])
    stage = schedule.stage_of_rank(rank)
    st = cfg.plan.stages[stage]
    module = StageModule(
        spec.build(st.first, st.last, cfg.seed).to(device).train(), cfg.optimizer_factory(),
        stage=stage, input_grad=stage > 0, stash=cfg.stash, vertical_sync=cfg.vertical_sync,
        loss_fn=spec.loss_fn, linear=LinearGradients.of(cfg.fused_accumulation),
    )
    data = None
    if stage in (0, cfg.plan.num_stages - 1):
        data = load_dataset(cfg.dataset, spec, data_dir=cfg.data_dir, seed=cfg.seed)
    units = data.units(cfg.layout.unit_size) if data is not None else None
    runner = RankRunner(schedule, rank, device, module, units, cfg.runner_options(),
                        groups=groups, links=links)
    barrier(max(cfg.timeout_s, _MIN_SETUP_S))
    report = runner.run(time.perf_counter())
    if report.replica == 0:
        report.state = runner.final_state()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(report, gathered, dst=0)
    # Every rank is past its last message before any tears its groups down. The
    # runner refers to itself (its bound action handlers, the gradient buckets'
    # wait): collect it now, or its process groups, with their gloo threads and
    # sockets, outlive destroy_process_group and go at interpreter shutdown,
    # after the peers have gone.
    barrier(max(cfg.timeout_s, _MIN_SETUP_S))
    del runner
    gc.collect()
    if rank != 0:
        return None
    assert gathered is not None
    reports: list[RankReport] = [r for r in gathered if isinstance(r, RankReport)]
    return assemble(cfg, spec, reports, data)


def _init_and_run(cfg: RunConfig, rank: int, world: int, local_rank: int) -> RunResult | None:
    spec = resolve_spec(cfg.model, cfg.model_kwargs)
    _check_layer_plan(cfg)
    check_config(cfg, spec, world)
    check_stage_outputs(cfg, spec)
    backend = cfg.backend_name
    device = torch.device("cpu")
    prepare_process()
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, rank=rank, world_size=world,
        timeout=timedelta(seconds=max(cfg.timeout_s, _MIN_SETUP_S)),
    )
    result = run_rank(cfg, rank, world, device, spec=spec)
    dist.destroy_process_group()
    return result


def run_from_env(cfg: RunConfig) -> RunResult | None:
    """Train under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); result on rank 0."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as exc:
        raise WorkerError(
            f"{exc.args[0]} is not set: run under torchrun, or use launch_local on one machine"
        ) from None
    return _init_and_run(cfg, rank, world, int(os.environ.get("LOCAL_RANK", "0")))


def launch_local(
    cfg: RunConfig,
    workers: int | None = None,
    *,
    deadline_s: float | None = None,
    spec: ModelSpec | None = None,
) -> RunResult:
    """Train with ``workers`` (default: the plan's) processes on this machine.

    ``deadline_s`` bounds the whole run; None leaves only the per-wait
    ``cfg.timeout_s``. ``spec`` is ``cfg.model`` when the caller has resolved
    it already. A failing rank's error is raised here, as its own
    DreampipeError class when it is one, with every failed rank's traceback.
    """
    world = cfg.workers if workers is None else workers
    spec = resolve_spec(cfg.model, cfg.model_kwargs) if spec is None else spec
    _check_layer_plan(cfg)
    check_config(cfg, spec, world)
    check_stage_outputs(cfg, spec)

    def where(rank: int) -> str:
        try:
            return f"stage {cfg.plan.stage_of_rank(rank)}"
        except DreampipeError:
            return "no stage"

    results = run_processes(
        _train_rank, world, cfg, threads=None if torch.cuda.is_available() else 1,
        deadline_s=deadline_s, where=where,
    )
    if not isinstance(results[0], RunResult):
        raise WorkerError("rank 0 finished without a result")
    return results[0]


def _check_layer_plan(cfg: RunConfig) -> None:
    """These launchers run one worker per schedule rank: a plan whose stages are split
    over workers (operator partitioning) runs through :class:`dreampipe.Pipeline`."""
    if cfg.plan.tensor_parallel > 1:
        raise ConfigError(
            f"plan {cfg.plan.config} splits its stages over {cfg.plan.tensor_parallel} "
            "workers; launch_local and run_from_env run layer plans only: train it with "
            "'dreampipe train --plan FILE' or dreampipe.Pipeline", "plan")


def _train_rank(_rank: int, _world: int, cfg: RunConfig) -> RunResult | None:
    """One local rank: exactly what torchrun runs, in torchrun's environment."""
    return run_from_env(cfg)



"""Reference trainers that ``dreampipe bench`` measures dreampipe against.

Each baseline trains the bench workload (:class:`Workload`) with PyTorch's
own machinery and no dreampipe code on the hot path:

- ``torch-1f1b`` / ``torch-gpipe``: ``torch.distributed.pipelining`` with a
  :class:`~torch.distributed.pipelining.PipelineStage` per rank built from the
  same :meth:`ModelSpec.build` slices and ``Schedule1F1B`` / ``ScheduleGPipe``;
- ``ddp``: ``DistributedDataParallel``, each rank a share of the update;
- ``single``: one process, the whole update as one batch.

Every baseline runs in fresh processes started by dreampipe's one launcher,
:func:`dreampipe.runtime.launch.run_processes`: a free port, one thread per
rank unless asked otherwise, a hard deadline, child tracebacks surfaced, and
no process left behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dreampipe.errors import BaselineError, ConfigError, DreampipeError
from dreampipe.models import ModelSpec, get_model
from dreampipe.runtime.launch import RankFn, run_processes

__all__ = ["Baseline", "Workload", "run_baseline"]

log = logging.getLogger(__name__)


class Baseline(Enum):
    """A PyTorch-only run the bench compares dreampipe with."""

    TORCH_1F1B = "torch-1f1b"
    TORCH_GPIPE = "torch-gpipe"
    DDP = "ddp"
    SINGLE_1THREAD = "single-1thread"
    SINGLE_2THREADS = "single-2threads"


@dataclass(frozen=True)
class Workload:
    """The bench workload: the zoo ``mlp`` cut in two, ``batch`` samples per update.

    ``steps`` timed weight updates follow ``warmup`` untimed ones; the
    pipelines split each update into ``microbatches`` microbatches.
    """

    layers: int = 8
    width: int = 1024
    batch: int = 256
    microbatches: int = 8
    steps: int = 20
    warmup: int = 3
    lr: float = 0.01
    seed: int = 0
    stage_bounds: tuple[int, ...] = (0, 4)

    def __post_init__(self) -> None:
        if self.batch % self.microbatches:
            raise DreampipeError(
                f"bench batch {self.batch} is not divisible by {self.microbatches} microbatches"
            )
        if self.steps < 1 or self.warmup < 0:
            raise ConfigError(
                f"bench steps={self.steps}, warmup={self.warmup}: use at least 1 timed step "
                "and no negative warm-up", "steps", "warmup",
            )

    def spec(self) -> ModelSpec:
        """The zoo mlp this workload trains."""
        return get_model("mlp", layers=self.layers, width=self.width)

    def stage_range(self, stage: int) -> tuple[int, int]:
        """First and last layer (inclusive) of pipeline stage ``stage``."""
        edges = [*self.stage_bounds, self.layers]
        return edges[stage], edges[stage + 1] - 1

    def data(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One fixed synthetic batch, reused every step so data costs nothing."""
        spec = self.spec()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + 1000)
            return spec.sample_input(batch), spec.sample_target(batch)


def _in_group(rank: int, world: int, arg: tuple[RankFn, Any]) -> Any:
    """``fn(rank, world, arg)`` inside a gloo process group of the ``world`` ranks (if > 1)."""
    fn, inner = arg
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return fn(rank, world, inner)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _on_processes(fn: RankFn, world: int, arg: Any, *, threads: int = 1,
                  timeout_s: float) -> list[Any]:
    """``fn`` on ``world`` fresh processes sharing a gloo group, through the one launcher."""
    return run_processes(_in_group, world, (fn, arg), threads=threads, deadline_s=timeout_s,
                         error=BaselineError)


def _timed(steps: int, warmup: int, step: Callable[[], None], sync: bool) -> float:
    """Seconds for ``steps`` calls of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    if sync:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if sync:
        dist.barrier()
    return time.perf_counter() - start


def _torch_pipeline(rank: int, world: int, arg: tuple[Workload, bool]) -> float:
    """One rank of ``torch.distributed.pipelining`` (1F1B or GPipe); samples/s."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    work, one_f_one_b = arg
    spec = work.spec()
    first, last = work.stage_range(rank)
    module = spec.build(first, last, seed=work.seed)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    kind = Schedule1F1B if one_f_one_b else ScheduleGPipe
    sched = kind(stage, n_microbatches=work.microbatches, loss_fn=spec.loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=work.lr)
    x, y = work.data(work.batch)

    def step() -> None:
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[], return_outputs=False)
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    elapsed = _timed(work.steps, work.warmup, step, sync=True)
    return work.steps * work.batch / elapsed


def _ddp(rank: int, world: int, work: Workload) -> float:
    """One rank of ``DistributedDataParallel`` with ``batch / world`` samples; samples/s."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(work.spec().build(seed=work.seed))
    share = work.batch // world
    x, y = work.data(work.batch)
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    return _whole_model_rate(work, model, x, y, sync=True)


def _single(rank: int, world: int, work: Workload) -> float:
    """The whole update as one batch in one process; samples/s."""
    model: nn.Module = work.spec().build(seed=work.seed)
    x, y = work.data(work.batch)
    return _whole_model_rate(work, model, x, y, sync=False)


def _whole_model_rate(
    work: Workload, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, sync: bool
) -> float:
    """Samples/s of plain SGD steps of ``model`` on ``(x, y)``: the update's share of a rank."""
    loss_fn = work.spec().loss_fn
    opt = torch.optim.SGD(model.parameters(), lr=work.lr)

    def step() -> None:
        torch.autograd.backward(loss_fn(model(x), y))
        opt.step()
        opt.zero_grad(set_to_none=True)

    elapsed = _timed(work.steps, work.warmup, step, sync=sync)
    return work.steps * work.batch / elapsed


def run_baseline(which: Baseline, work: Workload, *, timeout_s: float = 300.0) -> float:
    """Samples per second of ``which`` on ``work``, each in its own fresh processes."""
    pipeline_ranks = len(work.stage_bounds)
    log.info("baseline %s: %d timed steps after %d warm-up", which.value, work.steps, work.warmup)
    if which is Baseline.TORCH_1F1B:
        res = _on_processes(_torch_pipeline, pipeline_ranks, (work, True), timeout_s=timeout_s)
    elif which is Baseline.TORCH_GPIPE:
        res = _on_processes(_torch_pipeline, pipeline_ranks, (work, False), timeout_s=timeout_s)
    elif which is Baseline.DDP:
        res = _on_processes(_ddp, 2, work, timeout_s=timeout_s)
    elif which is Baseline.SINGLE_1THREAD:
        res = _on_processes(_single, 1, work, threads=1, timeout_s=timeout_s)
    else:
        res = _on_processes(_single, 1, work, threads=2, timeout_s=timeout_s)
    return float(res[0])

"""Reference trainers that ``dreampipe bench`` measures dreampipe against.

Each baseline trains the bench workload (:class:`~dreampipe.commands.workloads.Workload`)
with PyTorch's own machinery and no dreampipe code on the hot path:
``torch.distributed.pipelining`` schedules (``torch-1f1b``, ``torch-gpipe``,
``torch-zb``, ``torch-interleaved-1f1b`` and the ``-stock`` and ``-big``
variants of ``torch-1f1b``) on stages built from the same
:meth:`ModelSpec.build` slices, ``DistributedDataParallel`` (``ddp``,
``ddp-no-allreduce``) and one process (``single-1thread``,
``single-2threads``). Every baseline runs and is timed as dreampipe's runs
are (:mod:`dreampipe.commands.bench_process`). What each one is and why:
docs/training.md, "The bench".
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dreampipe.commands.bench_names import Baseline
from dreampipe.commands.bench_process import run_ranks, timed_rate
from dreampipe.commands.workloads import Workload
from dreampipe.errors import BaselineError
from dreampipe.runtime.processes import HeapPolicy, RankFn

__all__ = ["Baseline", "baseline_microbatch_size", "run_baseline"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _TorchPipe:
    """A ``torch.distributed.pipelining`` run: schedule, microbatch size, timed updates."""

    work: Workload
    which: Baseline
    microbatch: int

    @property
    def virtual_stages(self) -> int:
        """Stages per rank: 2 for the interleaved schedule, else 1."""
        return 2 if self.which is Baseline.TORCH_INTERLEAVED else 1

    @property
    def update(self) -> int:
        return self.microbatch * self.work.microbatches

    def updates(self, n: int) -> int:
        """Updates of this run that train at least ``n`` of the workload's updates' samples."""
        return math.ceil(n * self.work.batch / self.update)


def _torch_pipeline(rank: int, world: int, run: _TorchPipe) -> float:
    """One rank of ``torch.distributed.pipelining`` (1F1B, GPipe, zero bubble or
    interleaved 1F1B); samples/s."""
    from torch.distributed import pipelining as pp

    work = run.work
    spec = work.spec()
    v = run.virtual_stages
    mine = range(rank, world * v, world)
    modules = [spec.build(*work.stage_range(s, v), seed=work.seed) for s in mine]
    stages: list[Any] = [pp.PipelineStage(m, s, world * v, torch.device("cpu"))
                         for m, s in zip(modules, mine, strict=True)]
    sched: Any
    if run.which in (Baseline.TORCH_ZB, Baseline.TORCH_INTERLEAVED):
        multi = (pp.ScheduleInterleavedZeroBubble if run.which is Baseline.TORCH_ZB
                 else pp.ScheduleInterleaved1F1B)
        sched = multi(stages, n_microbatches=work.microbatches, loss_fn=spec.loss_fn)
    else:
        single = pp.ScheduleGPipe if run.which is Baseline.TORCH_GPIPE else pp.Schedule1F1B
        sched = single(stages[0], n_microbatches=work.microbatches, loss_fn=spec.loss_fn)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=work.lr)
    x, y = work.data(run.update)

    def step() -> None:
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[], return_outputs=False)
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed_rate(step, steps=run.updates(work.steps), warmup=run.updates(work.warmup),
                      samples_per_step=run.update)


def _ddp(rank: int, world: int, arg: tuple[Workload, bool]) -> float:
    """One rank of ``DistributedDataParallel`` with ``batch / world`` samples; samples/s.

    ``arg``: the workload, and whether the backward all-reduces (else ``no_sync``).
    """
    from torch.nn.parallel import DistributedDataParallel

    work, sync = arg
    model = DistributedDataParallel(work.spec().build(seed=work.seed))
    share = work.per_worker
    x, y = work.data(work.batch)
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    return _whole_model_rate(work, model, x, y, no_sync=None if sync else model.no_sync)


def _single(rank: int, world: int, work: Workload) -> float:
    """The whole update as one batch in one process; samples/s."""
    model: nn.Module = work.spec().build(seed=work.seed)
    x, y = work.data(work.batch)
    return _whole_model_rate(work, model, x, y)


def _whole_model_rate(
    work: Workload, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
    no_sync: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
) -> float:
    """Samples/s of plain SGD steps of ``model`` on ``(x, y)``: the update's share of a rank
    (each backward inside ``no_sync()`` if given)."""
    loss_fn = work.spec().loss_fn
    opt = torch.optim.SGD(model.parameters(), lr=work.lr)
    around = no_sync or contextlib.nullcontext

    def step() -> None:
        with around():
            torch.autograd.backward(loss_fn(model(x), y))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed_rate(step, steps=work.steps, warmup=work.warmup, samples_per_step=work.batch)


def baseline_microbatch_size(which: Baseline, work: Workload) -> int:
    """Samples in one forward and backward of ``which``: a microbatch, a share, a batch."""
    if which in (Baseline.TORCH_1F1B_BIG, Baseline.DDP, Baseline.DDP_NO_ALLREDUCE):
        return work.per_worker
    if which in (Baseline.SINGLE_1THREAD, Baseline.SINGLE_2THREADS):
        return work.batch
    return work.microbatch


def run_baseline(which: Baseline, work: Workload, *, timeout_s: float = 300.0) -> float:
    """Samples per second of ``which`` on ``work``, each in its own fresh processes."""
    ranks = len(work.stage_bounds)
    log.info("baseline %s: %d timed steps after %d warm-up", which.value, work.steps, work.warmup)
    fn: RankFn
    arg: Workload | _TorchPipe | tuple[Workload, bool] = work
    if which in (Baseline.DDP, Baseline.DDP_NO_ALLREDUCE):
        fn, world, arg = _ddp, ranks, (work, which is Baseline.DDP)
    elif which in (Baseline.SINGLE_1THREAD, Baseline.SINGLE_2THREADS):
        fn, world = _single, 1
    else:
        fn, world = _torch_pipeline, ranks
        arg = _TorchPipe(work, which, microbatch=baseline_microbatch_size(which, work))
    return run_ranks(
        fn, world, arg, timeout_s=timeout_s, threads=2 if which is Baseline.SINGLE_2THREADS else 1,
        heap=HeapPolicy.STOCK if which is Baseline.TORCH_1F1B_STOCK else HeapPolicy.KEEP_FREED,
        error=BaselineError,
    )

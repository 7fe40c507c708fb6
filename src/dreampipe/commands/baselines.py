"""Reference trainers that ``dreampipe bench`` measures dreampipe against.

Each baseline trains the bench workload (:class:`~dreampipe.commands.workloads.Workload`)
with PyTorch's own machinery and no dreampipe code on the hot path:
``torch.distributed.pipelining`` schedules (``torch-1f1b``, ``torch-gpipe``,
``torch-zb``, ``torch-interleaved-1f1b``, ``torch-zbv``, ``torch-dualpipev`` and
the ``-stock`` and ``-big`` variants of ``torch-1f1b``) on stages built from the same
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


#: PyTorch's schedules of several stages per rank, by baseline.
_MULTI = {Baseline.TORCH_ZB: "ScheduleInterleavedZeroBubble",
          Baseline.TORCH_INTERLEAVED: "ScheduleInterleaved1F1B",
          Baseline.TORCH_ZBV: "ScheduleZBVZeroBubble",
          Baseline.TORCH_DUALPIPEV: "ScheduleDualPipeV"}
#: The baselines that run the workload's 4 chunks, 2 a rank (the rest: its 2 stages).
_TWO_A_RANK = (Baseline.TORCH_INTERLEAVED, Baseline.TORCH_ZBV, Baseline.TORCH_DUALPIPEV)
#: The baselines that place those chunks in a V: chunks ``r`` and ``2p - 1 - r`` on rank ``r``.
_V = (Baseline.TORCH_ZBV, Baseline.TORCH_DUALPIPEV)


@dataclass(frozen=True)
class _TorchPipe:
    """A ``torch.distributed.pipelining`` run: schedule, microbatch size, timed updates."""

    work: Workload
    which: Baseline
    microbatch: int

    @property
    def virtual_stages(self) -> int:
        """Stages per rank: 2 for the interleaved and V-shaped schedules, else 1."""
        return 2 if self.which in _TWO_A_RANK else 1

    def stages(self, rank: int, world: int) -> tuple[int, ...]:
        """The stages ``rank`` runs: its own, every ``world``-th chunk, or 2 in the V."""
        if self.which in _V:
            return (rank, 2 * world - 1 - rank)
        return tuple(range(rank, world * self.virtual_stages, world))

    @property
    def update(self) -> int:
        return self.microbatch * self.work.microbatches

    def updates(self, n: int) -> int:
        """Updates of this run that train at least ``n`` of the workload's updates' samples."""
        return math.ceil(n * self.work.batch / self.update)


def _torch_pipeline(rank: int, world: int, run: _TorchPipe) -> float:
    """One rank of ``torch.distributed.pipelining`` (1F1B, GPipe, zero bubble, interleaved
    1F1B, ZB-V or DualPipeV); samples/s."""
    from torch.distributed import pipelining as pp

    work = run.work
    v = run.virtual_stages
    mine = run.stages(rank, world)
    stages = _stages(work, v, mine, world, run.microbatch)
    modules = [st.submod for st in stages]
    sched: Any
    if run.which in _MULTI:
        multi = getattr(pp, _MULTI[run.which])
        sched = multi(stages, n_microbatches=work.microbatches, loss_fn=work.loss_fn)
    else:
        single = pp.ScheduleGPipe if run.which is Baseline.TORCH_GPIPE else pp.Schedule1F1B
        sched = single(stages[0], n_microbatches=work.microbatches, loss_fn=work.loss_fn)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=work.lr)
    x, y = work.data(run.update)
    first, last = 0 in mine, world * v - 1 in mine
    args = (x,) if first and not work.hf else ()
    kwargs = {**(x if first and work.hf else {}), **({"target": y, "losses": []} if last else {})}

    def step() -> None:
        sched.step(*args, **kwargs, return_outputs=False)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed_rate(step, steps=run.updates(work.steps), warmup=run.updates(work.warmup),
                      samples_per_step=run.update)


def _stages(work: Workload, v: int, mine: tuple[int, ...], world: int, microbatch: int
            ) -> list[Any]:
    """``torch.distributed.pipelining`` stages ``mine`` of ``world * v``, built from the
    same slices as dreampipe's: a zoo model's by :meth:`ModelSpec.build`; a Hugging Face
    model's by PyTorch's own ``pipeline()`` at the same split points, traced on one
    microbatch, where PyTorch's runtime can run its stages (one a rank)."""
    from torch.distributed import pipelining as pp

    cpu = torch.device("cpu")
    if work.hf and v == 1:
        pipe = pp.pipeline(work.model(), mb_args=(), mb_kwargs=work.data(microbatch)[0],
                           split_spec=dict.fromkeys(work.split_points(v),
                                                    pp.SplitPoint.BEGINNING))
        return [pipe.build_stage(s, cpu) for s in mine]
    if work.hf:
        return [pp.PipelineStage(m, s, world * v, cpu, input_args=a, output_args=b)
                for s, (m, a, b) in zip(mine, _hf_chunks(work, v, mine, microbatch),
                                        strict=True)]
    spec = work.spec()
    modules = [spec.build(*work.stage_range(s, v), seed=work.seed) for s in mine]
    return [pp.PipelineStage(m, s, world * v, cpu) for m, s in zip(modules, mine, strict=True)]


class _Chunk(nn.Module):
    """A chunk called as PyTorch's schedules call a stage: the first with the model's
    keyword arguments, which dreampipe's chunk takes as one dict; the rest with what the
    chunk before sent (and the same keyword arguments, which a schedule of several stages
    a rank hands every stage of the rank's: ignored). The last gives the logits: a
    stage's outputs are tensors."""

    def __init__(self, chunk: nn.Module, first: bool) -> None:
        super().__init__()
        self.chunk, self.first = chunk, first

    def forward(self, *sent: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        out = self.chunk(inputs) if self.first else self.chunk(*sent)
        return out if isinstance(out, torch.Tensor) else out.logits


def _hf_chunks(work: Workload, v: int, mine: tuple[int, ...], microbatch: int
               ) -> list[tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]]:
    """A Hugging Face model's chunks ``mine`` cut by hand, each with what it takes and
    gives on one microbatch: dreampipe's layers of it
    (:func:`~dreampipe.splitter.chain.split_layers`, traced on one microbatch), the same
    slices as its split points, each chunk sending the next one tensor (which PyTorch's
    stages cannot infer on ``meta``: its values say how to unpack it).

    ``pipeline()`` cannot serve here: it sends what the model computes before its first
    layer (Llama's rotary position embeddings) from the first stage straight to every
    later one, and PyTorch's schedules of several stages a rank refuse such skips
    ("PipelineScheduleMulti only supports adjacent-stage communication").
    """
    from dreampipe.splitter.chain import Chain, split_layers

    x = work.data(microbatch)[0]
    layers = split_layers(work.model(), x)
    chunks: list[tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]] = []
    value: Any = x
    for s in range(2 * v):
        first, last = work.stage_range(s, v)
        chunk = Chain(layers[first:last + 1])
        out = chunk(value)  # with autograd: a received tensor must want its gradient
        logits = out if isinstance(out, torch.Tensor) else out.logits
        if s in mine:
            takes = tuple(x.values()) if first == 0 else (value,)
            chunks.append((_Chunk(chunk, first == 0), takes, logits))
        value = out
    return chunks


def _ddp(rank: int, world: int, arg: tuple[Workload, bool]) -> float:
    """One rank of ``DistributedDataParallel`` with ``batch / world`` samples; samples/s.

    ``arg``: the workload, and whether the backward all-reduces (else ``no_sync``).
    """
    from torch.nn.parallel import DistributedDataParallel

    work, sync = arg
    model = DistributedDataParallel(work.model())
    share = slice(rank * work.per_worker, (rank + 1) * work.per_worker)
    x, y = work.data(work.batch)
    x = {k: t[share] for k, t in x.items()} if isinstance(x, dict) else x[share]
    y = y[share]
    return _whole_model_rate(work, model, x, y, no_sync=None if sync else model.no_sync)


def _single(rank: int, world: int, work: Workload) -> float:
    """The whole update as one batch in one process; samples/s."""
    model = work.model()
    x, y = work.data(work.batch)
    return _whole_model_rate(work, model, x, y)


def _whole_model_rate(
    work: Workload, model: nn.Module, x: Any, y: torch.Tensor,
    no_sync: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
) -> float:
    """Samples/s of plain SGD steps of ``model`` on ``(x, y)``: the update's share of a rank
    (each backward inside ``no_sync()`` if given); a dict ``x`` is keyword arguments."""
    loss_fn = work.loss_fn
    opt = torch.optim.SGD(model.parameters(), lr=work.lr)
    around = no_sync or contextlib.nullcontext
    args, kwargs = ((), x) if isinstance(x, dict) else ((x,), {})

    def step() -> None:
        with around():
            torch.autograd.backward(loss_fn(model(*args, **kwargs), y))
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
    ranks = work.workers
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

"""A layer profile taken beside busy twins, as local workers compute side by side in a run.

Local workers share caches, memory bandwidth and, on a virtual machine, the
host's cores. :func:`profile_beside` takes the layer profile in ``1 + twins``
one-thread processes at once and keeps the slowest process's, since a run's
synchronous steps go at its slowest worker's pace; ``crowd`` more processes
measure how a run with more workers than cores shares them
(docs/design.md §9.1).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from dreampipe.errors import ConfigError, ProfileError
from dreampipe.machine.corun import ModelJob, training_round
from dreampipe.models.resolve import resolve_spec
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runtime.precision import Precision
from dreampipe.runtime.processes import run_processes

__all__ = ["profile_beside"]

log = logging.getLogger(__name__)


def profile_beside(
    model: str,
    batch_size: int,
    twins: int,
    *,
    crowd: int = 0,
    model_kwargs: Sequence[tuple[str, Any]] = (),
    repeats: int = 5,
    min_time_s: float = 0.0,
    deadline_s: float = 600.0,
    precision: Precision = Precision.FP32,
) -> LayerGraph:
    """The layer profile of ``model`` at ``batch_size`` (one thread) beside ``twins`` busy twins.

    Every process is a fresh one-thread worker with the runtime's set-up
    (:func:`~dreampipe.runtime.processes.run_processes`) that profiles the
    model (``repeats``, ``min_time_s`` as for
    :func:`~dreampipe.profiling.profiler.profile_spec`) and the runtime's
    overhead (:mod:`~dreampipe.runplan.runtime_overhead`), then runs its forward
    and backward at the same batch until every process has profiled; then
    all measure the all-reduce, step and stash-copy rates (:mod:`~dreampipe.machine.rates`,
    in ``meta``). The slowest profile (largest forward+backward) is kept; its
    ``meta["twins"]`` says how many ran beside it, ``meta["profiles_ms"]`` every
    process's total. ``crowd`` more processes (a run with more workers than
    cores) wait meanwhile, then all train at once: :func:`_crowd_pace`. The profile
    times the layers in ``precision``'s number formats.
    """
    if twins < 0:
        raise ConfigError(f"twins={twins}: use 0 or more busy twins", "twins")
    if crowd < 0:
        raise ConfigError(f"crowd={crowd}: use 0 or more processes", "crowd")
    job = ModelJob(model, tuple(model_kwargs), batch_size, repeats, min_time_s,
                   precision.value)
    results: list[tuple[list[LayerGraph], float] | None] = run_processes(
        _profile_rank, 1 + twins + crowd, (job, 1 + twins), deadline_s=deadline_s,
        error=ProfileError)
    found = results[0]
    assert found is not None
    graphs, share = found
    totals = [g.total_ms() for g in graphs]
    slowest = graphs[totals.index(max(totals))]
    log.info("profiled %s in %d processes at once: forward+backward %s ms; keeping the slowest",
             model, len(graphs), ", ".join(f"{t:.2f}" for t in totals))
    meta = {**slowest.meta, "twins": twins, "profiles_ms": [round(t, 3) for t in totals]}
    if crowd:
        log.info("%d processes train at %.2fx the time of %d", len(results), share, 1 + twins)
        meta |= {"share": round(share, 4), "shared_by": 1 + twins + crowd,
                 "share_cores": len(os.sched_getaffinity(0))}
    return replace(slowest, meta=meta)


def _profile_rank(
    rank: int, world: int, work: tuple[ModelJob, int]
) -> tuple[list[LayerGraph], float] | None:
    """The ``profiling`` first ranks profile once all compute, then compute until all
    have profiled, then measure the host's rates together
    (:mod:`~dreampipe.machine.rates`); the crowd waits, then all find the pace
    (:func:`_crowd_pace`); rank 0 gathers the profiles and that pace."""
    from dreampipe.machine.rates import compute_until_joined, measure_rates, with_host_rates
    from dreampipe.profiling.profiler import profile_spec
    from dreampipe.runplan.runtime_overhead import with_runtime_overhead

    job, profiling = work
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        # not a training rank: model code that acts on one (logs, files) stays quiet
        # here, as in a profile taken in the launcher itself
        os.environ.pop(name, None)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        spec = resolve_spec(job.model, job.model_kwargs)
        net = spec.build(seed=rank)
        train_once = training_round(spec, job.batch_size, net)
        train_once()
        group = dist.new_group(list(range(profiling))) if profiling < world else None
        dist.barrier()  # every process is ready to compute
        graph: LayerGraph | None = None
        if rank < profiling:
            graph = with_runtime_overhead(
                profile_spec(spec, batch_size=job.batch_size, repeats=job.repeats,
                             min_time_s=job.min_time_s,
                             autocast=Precision(job.precision).autocast,
                             param_dtype=Precision(job.precision).param_dtype), spec)
        compute_until_joined(train_once, rank < profiling)
        if graph is not None:
            graph = with_host_rates(graph, measure_rates(list(net.parameters()), group=group,
                                                        beside=train_once))
        share = _crowd_pace(train_once, rank, profiling) if profiling < world else 1.0
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(graph, gathered, dst=0)
        return None if gathered is None else (
            [g for g in gathered if isinstance(g, LayerGraph)], share)
    finally:
        dist.destroy_process_group()


#: Seconds each process trains for in each phase of :func:`_crowd_pace`, at the least.
_PACE_S = 0.5
#: Rank 0's passes alone a phase lasts at the least, so that a slow model's pace is a
#: mean over passes too, not over one or two.
_PACE_PASSES = 8
#: Whether each phase is crowded: alone and crowded in mirrored order, so that a host
#: whose speed drifts over the seconds slows both alike (one after the other, the
#: drift between the two phases lands in the pace as if the crowd had caused it).
_PHASES = (False, True, True, False)


def _crowd_pace(train_once: Callable[[], None], rank: int, profiling: int) -> float:
    """How much longer the slowest process's forward+backward takes with every process
    training at once than with only the ``profiling`` first ranks (the slowest of them,
    whose profile is kept): the share of the cores a worker gets in a run with more
    workers than cores, as the host's scheduler gives it (a waiting worker takes none:
    gloo's waits sleep). Each phase ends at one instant on every rank; each process's
    pace is its mean over the phases of a kind::

        ranks < profiling   [alone] | [crowded] | [crowded] | [alone]
        the crowd           (waits) | [crowded] | [crowded] | (waits)
                                    ^ barrier between phases
    """
    start = time.time()
    if rank == 0:
        train_once()
    phase_s = max(_PACE_S, _PACE_PASSES * (time.time() - start))  # rank 0's is broadcast
    took: dict[bool, list[float]] = {False: [], True: []}
    for crowded in _PHASES:
        deadline = _deadline(phase_s)
        if crowded or rank < profiling:
            took[crowded].append(_mean_pass_s(train_once, deadline))
        dist.barrier()
    alone = statistics.fmean(took[False]) if took[False] else 0.0
    paces = torch.tensor([[alone, statistics.fmean(took[True])]], dtype=torch.float64)
    every = [torch.zeros_like(paces) for _ in range(dist.get_world_size())]
    dist.all_gather(every, paces)
    both = torch.cat(every)
    return float(both[:, 1].max()) / float(both[:profiling, 0].max())


def _deadline(seconds: float) -> float:
    """An instant rank 0's ``seconds`` from its now, on the clock every local rank shares."""
    instant = torch.tensor([time.time() + seconds], dtype=torch.float64)
    dist.broadcast(instant, src=0)
    return float(instant.item())


def _mean_pass_s(train_once: Callable[[], None], deadline: float) -> float:
    """Mean seconds of the passes that end by ``deadline``; training goes on until one ends
    after it, so that every process computes until then."""
    start = time.time()
    last_end, ended = start, 0
    while True:
        train_once()
        now = time.time()
        if now > deadline:
            return (last_end - start) / ended if ended else now - start
        last_end, ended = now, ended + 1

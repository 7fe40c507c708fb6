"""How fast a worker computes beside busy twins, as local workers do in a run.

Local workers share caches, memory bandwidth and, on a virtual machine, the
host's cores, at a cost that depends on the model and the host. Two
measurements (docs/design.md §9.1):

- :func:`profile_beside` takes the layer profile in ``1 + twins`` processes at
  once and keeps the slowest process's, since a run's synchronous steps go at
  its slowest worker's pace (``dreampipe train``'s profile);
- :func:`measure_corun` times one model's forward and backward alone, then
  beside a twin: the factor :class:`~dreampipe.machine.calibration.LocalCalibration`
  keeps for profiles taken alone. The twin runs two rounds more, so the timed
  rank never runs alone while it is timed beside it.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from dreampipe.errors import ConfigError, ProfileError
from dreampipe.models.resolve import resolve_spec
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runtime.processes import run_processes

__all__ = ["Corun", "corun_in_group", "measure_corun", "profile_beside"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Corun:
    """Seconds of a forward and backward, alone and beside a busy twin."""

    alone_s: tuple[float, ...]
    beside_s: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """Median beside over median alone, as measured."""
        return statistics.median(self.beside_s) / statistics.median(self.alone_s)

    @property
    def slowdown(self) -> float:
        """The factor for ``corun_slowdown``: :attr:`ratio`, at least 1. A worker beside a
        busy twin never computes faster than alone; a ratio below 1 means the host was
        busier while the lone rounds ran, and is taken as no slowdown."""
        return max(1.0, self.ratio)

    def describe(self) -> str:
        def spread(values: tuple[float, ...]) -> str:
            return (f"{statistics.median(values) * 1e3:.0f} ms "
                    f"({min(values) * 1e3:.0f}-{max(values) * 1e3:.0f})")

        noisy = (f" (measured x{self.ratio:.3f}: the host was busier while timing alone; "
                 "calibrate again on a quiet machine)" if self.ratio < 1.0 else "")
        return (f"forward+backward alone {spread(self.alone_s)}, beside a busy worker "
                f"{spread(self.beside_s)}: x{self.slowdown:.3f}{noisy}")


@dataclass(frozen=True)
class _Job:
    model: str
    model_kwargs: tuple[tuple[str, Any], ...]
    batch_size: int
    repeats: int
    min_time_s: float = 0.0


def measure_corun(
    model: str,
    batch_size: int,
    *,
    model_kwargs: Sequence[tuple[str, Any]] = (),
    repeats: int = 3,
    deadline_s: float = 300.0,
) -> Corun:
    """Time ``model``'s forward and backward at ``batch_size`` alone, then beside a twin.

    Two fresh one-thread processes (gloo barriers only); ``repeats`` timed
    rounds each way after one warm-up round.
    """
    if repeats < 1:
        raise ConfigError(f"repeats={repeats}: time at least 1 round", "repeats")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size}: use at least 1 sample", "batch_size")
    job = _Job(model, tuple(model_kwargs), batch_size, repeats)
    results: list[Corun | None] = run_processes(
        _rank, 2, job, deadline_s=deadline_s, error=ProfileError)
    found = results[0]
    assert found is not None
    return found


def _rank(rank: int, world: int, job: _Job) -> Corun | None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return _in_group(rank, job)
    finally:
        dist.destroy_process_group()


def corun_in_group(
    model: str, batch_size: int, *, model_kwargs: Sequence[tuple[str, Any]] = (),
    repeats: int = 3,
) -> Corun | None:
    """:func:`measure_corun` on ranks 0 and 1 of the default group (every rank calls it;
    the others only wait at its barriers); rank 0 gets the result, the others None."""
    return _in_group(dist.get_rank(), _Job(model, tuple(model_kwargs), batch_size, repeats))


def _in_group(rank: int, job: _Job) -> Corun | None:
    alone = _timed(job, job.repeats) if rank == 0 else ()
    dist.barrier()
    beside = _timed(job, job.repeats + 2 * rank) if rank < 2 else ()
    dist.barrier()
    return Corun(alone, beside) if rank == 0 else None


def _training_round(job: _Job, net: torch.nn.Module | None = None) -> Callable[[], None]:
    """One forward and backward of ``net`` (None: a fresh ``job.model``) at ``job``'s batch,
    ready to run again."""
    spec = resolve_spec(job.model, job.model_kwargs)
    net = spec.build(seed=0) if net is None else net
    x, y = spec.sample_input(job.batch_size), spec.sample_target(job.batch_size)

    def run() -> None:
        net.zero_grad(set_to_none=True)
        torch.autograd.backward(spec.loss_fn(net(x), y))

    return run


def _timed(job: _Job, repeats: int) -> tuple[float, ...]:
    """Seconds of each of ``repeats`` forward+backward rounds, after one warm-up."""
    train_once = _training_round(job)
    took = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        train_once()
        took.append(time.perf_counter() - start)
    return tuple(took[1:])


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
) -> LayerGraph:
    """The layer profile of ``model`` at ``batch_size`` (one thread) beside ``twins`` busy twins.

    Every process is a fresh one-thread worker with the runtime's set-up
    (:func:`~dreampipe.runtime.processes.run_processes`) that profiles the
    model (``repeats``, ``min_time_s`` as for
    :func:`~dreampipe.profiling.profiler.profile_spec`) and the runtime's
    overhead (:mod:`~dreampipe.machine.overhead`), then runs its forward
    and backward at the same batch until every process has profiled; then
    all measure the all-reduce, step and stash-copy rates (:mod:`~dreampipe.machine.rates`,
    in ``meta``). The slowest profile (largest forward+backward) is kept; its
    ``meta["twins"]`` says how many ran beside it, ``meta["profiles_ms"]`` every
    process's total. ``crowd`` more processes (a run with more workers than
    cores) wait meanwhile, then all train at once: :func:`_crowd_pace`.
    """
    if twins < 0:
        raise ConfigError(f"twins={twins}: use 0 or more busy twins", "twins")
    if crowd < 0:
        raise ConfigError(f"crowd={crowd}: use 0 or more processes", "crowd")
    job = _Job(model, tuple(model_kwargs), batch_size, repeats, min_time_s)
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
    rank: int, world: int, work: tuple[_Job, int]
) -> tuple[list[LayerGraph], float] | None:
    """The ``profiling`` first ranks profile once all compute, then compute until all
    have profiled, then measure the host's rates together
    (:mod:`~dreampipe.machine.rates`); the crowd waits, then all find the pace
    (:func:`_crowd_pace`); rank 0 gathers the profiles and that pace."""
    from dreampipe.machine.overhead import with_runtime_overhead
    from dreampipe.machine.rates import compute_until_joined, measure_rates, with_host_rates
    from dreampipe.profiling.profiler import profile_spec

    job, profiling = work
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        # not a training rank: model code that acts on one (logs, files) stays quiet
        # here, as in a profile taken in the launcher itself
        os.environ.pop(name, None)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        spec = resolve_spec(job.model, job.model_kwargs)
        net = spec.build(seed=rank)
        train_once = _training_round(job, net)
        train_once()
        group = dist.new_group(list(range(profiling))) if profiling < world else None
        dist.barrier()  # every process is ready to compute
        graph: LayerGraph | None = None
        if rank < profiling:
            graph = with_runtime_overhead(
                profile_spec(spec, batch_size=job.batch_size, repeats=job.repeats,
                             min_time_s=job.min_time_s), spec)
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

"""How fast a worker computes beside a busy twin, as local workers do in a run.

Local workers share caches, memory bandwidth and, on a virtual machine, the
host's cores, at a cost that depends on the model and the host.
:func:`measure_corun` times one model's forward and backward alone, then
beside a twin: the factor :class:`~dreampipe.machine.calibration.LocalCalibration`
keeps for profiles taken alone (docs/design.md §9.1). The twin runs two
rounds more, so the timed rank never runs alone while it is timed beside it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dreampipe.errors import ConfigError, ProfileError
from dreampipe.models.resolve import resolve_spec
from dreampipe.models.spec import ModelSpec
from dreampipe.runtime.processes import run_processes

__all__ = ["Corun", "ModelJob", "corun_in_group", "measure_corun", "training_round"]

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
class ModelJob:
    """A zoo model's forward and backward at ``batch_size``, timed ``repeats`` rounds (and
    at least ``min_time_s`` where a profile takes it)."""

    model: str
    model_kwargs: tuple[tuple[str, Any], ...]
    batch_size: int
    repeats: int
    min_time_s: float = 0.0
    precision: str = "fp32"  # a Precision's value: the formats the profile times in


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
    job = ModelJob(model, tuple(model_kwargs), batch_size, repeats)
    results: list[Corun | None] = run_processes(
        _rank, 2, job, deadline_s=deadline_s, error=ProfileError)
    found = results[0]
    assert found is not None
    return found


def _rank(rank: int, world: int, job: ModelJob) -> Corun | None:
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
    return _in_group(dist.get_rank(), ModelJob(model, tuple(model_kwargs), batch_size, repeats))


def _in_group(rank: int, job: ModelJob) -> Corun | None:
    alone = _timed(job, job.repeats) if rank == 0 else ()
    dist.barrier()
    beside = _timed(job, job.repeats + 2 * rank) if rank < 2 else ()
    dist.barrier()
    return Corun(alone, beside) if rank == 0 else None


def training_round(spec: ModelSpec, batch_size: int, net: torch.nn.Module) -> Callable[[], None]:
    """One forward and backward of ``net`` at ``batch_size``, ready to run again."""
    x, y = spec.sample_input(batch_size), spec.sample_target(batch_size)

    def run() -> None:
        net.zero_grad(set_to_none=True)
        torch.autograd.backward(spec.loss_fn(net(x), y))

    return run


def _timed(job: ModelJob, repeats: int) -> tuple[float, ...]:
    """Seconds of each of ``repeats`` forward+backward rounds, after one warm-up."""
    spec = resolve_spec(job.model, job.model_kwargs)
    train_once = training_round(spec, job.batch_size, spec.build(seed=0))
    took = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        train_once()
        took.append(time.perf_counter() - start)
    return tuple(took[1:])

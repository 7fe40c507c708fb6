"""How much slower a worker computes beside a busy twin than alone.

The layer profile is taken in one process, alone on the machine. Local
workers compute side by side, sharing caches, memory bandwidth and, on a
virtual machine, whatever the host gives two busy cores at once, so
:class:`~dreampipe.jobs.machine.LocalCalibration` scales their compute by a
``corun_slowdown``. :func:`measure_corun` measures it for one model and
batch as the machine is now::

    rank 0   [alone: warm-up, repeats] | [beside: warm-up, repeats]
    rank 1   (waits at the barrier)    | [same work, 2 more rounds]
                                       ^ barrier

Rank 1 runs two rounds more than rank 0, so rank 0 is never timed alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dreampipe.errors import ConfigError, ProfileError
from dreampipe.models.resolve import resolve_spec
from dreampipe.runtime.processes import run_processes

__all__ = ["Corun", "measure_corun"]


@dataclass(frozen=True)
class Corun:
    """Seconds of a forward and backward, alone and beside a busy twin."""

    alone_s: tuple[float, ...]
    beside_s: tuple[float, ...]

    @property
    def slowdown(self) -> float:
        """Median beside over median alone: the factor for ``corun_slowdown``."""
        return statistics.median(self.beside_s) / statistics.median(self.alone_s)

    def describe(self) -> str:
        def spread(values: tuple[float, ...]) -> str:
            return (f"{statistics.median(values) * 1e3:.0f} ms "
                    f"({min(values) * 1e3:.0f}-{max(values) * 1e3:.0f})")

        return (f"forward+backward alone {spread(self.alone_s)}, beside a busy worker "
                f"{spread(self.beside_s)}: x{self.slowdown:.3f}")


@dataclass(frozen=True)
class _Job:
    model: str
    model_kwargs: tuple[tuple[str, Any], ...]
    batch_size: int
    repeats: int


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
        alone = _timed(job, job.repeats) if rank == 0 else ()
        dist.barrier()
        beside = _timed(job, job.repeats + 2 * rank)
        dist.barrier()
        return Corun(alone, beside) if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _timed(job: _Job, repeats: int) -> tuple[float, ...]:
    """Seconds of each of ``repeats`` forward+backward rounds, after one warm-up."""
    spec = resolve_spec(job.model, job.model_kwargs)
    net = spec.build(seed=0)
    x, y = spec.sample_input(job.batch_size), spec.sample_target(job.batch_size)
    took = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        net.zero_grad(set_to_none=True)
        torch.autograd.backward(spec.loss_fn(net(x), y))
        took.append(time.perf_counter() - start)
    return tuple(took[1:])

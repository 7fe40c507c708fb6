"""How every ``dreampipe bench`` run is started and timed: one way for all of them.

Each run, dreampipe's and PyTorch's alike, trains in fresh processes from
the runtime's one launcher (:func:`dreampipe.runtime.processes.run_processes`),
so each gets :func:`~dreampipe.runtime.processes.prepare_process`'s set-up (one
thread, the heap policy), and joins one gloo process group when it has more
than one rank. Each is timed by :func:`timed_rate`::

    warm-up steps, drain ── barrier ── timed steps, drain ── barrier
                               t0 ◀──────── wall clock ────────▶ t1

so a pipeline's fill and drain inside the timed steps count, as they do for
anyone training that many samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from dreampipe.errors import DreampipeError
from dreampipe.runtime.processes import HeapPolicy, RankFn, run_processes

__all__ = ["run_ranks", "timed_rate"]


def _in_group(rank: int, world: int, arg: tuple[RankFn, Any]) -> Any:
    """``fn(rank, world, arg)`` inside a gloo process group of the ``world`` ranks (if > 1).
    Every rank is connected before any runs ``fn``: a rank that returns or fails at once
    would otherwise leave the group while a peer still connects, which then fails with
    gloo's error instead of its own."""
    fn, inner = arg
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        dist.barrier()
    try:
        return fn(rank, world, inner)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: RankFn, world: int, arg: Any, *, timeout_s: float, threads: int = 1,
    heap: HeapPolicy = HeapPolicy.KEEP_FREED, error: type[DreampipeError] | None = None,
) -> float:
    """``fn`` on ``world`` fresh processes sharing a gloo group; rank 0's result (samples/s).

    ``error`` is the class a failed rank raises here (None: the rank's own
    DreampipeError class, else WorkerError).
    """
    res = run_processes(_in_group, world, (fn, arg), threads=threads, deadline_s=timeout_s,
                        error=error, heap=heap)
    return float(res[0])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def timed_rate(
    step: Callable[[], None], *, steps: int, warmup: int, samples_per_step: int,
    drain: Callable[[], object] | None = None,
) -> float:
    """Samples/s of ``steps`` calls of ``step``, between barriers on all ranks.

    ``warmup`` untimed calls (and ``drain``, which finishes what the calls
    left in flight) come first; the clock runs from a barrier after them to
    a barrier after the timed calls and their ``drain``.
    """
    for _ in range(warmup):
        step()
    if drain is not None:
        drain()
    _barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if drain is not None:
        drain()
    _barrier()
    return steps * samples_per_step / (time.perf_counter() - start)

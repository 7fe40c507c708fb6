"""The host's all-reduce, update and stash-copy rates, measured with each local profile.

A local run's prediction needs, beyond the layer times, how fast the workers
all-reduce gradients, apply an SGD step and copy a stashed weight version.
These are memory-bound and drift with the host as compute does, so the
processes that profile beside each other
(:func:`~dreampipe.runplan.profile_beside.profile_beside`) measure them too and keep
them in the graph's meta, which
:func:`~dreampipe.machine.calibration.measured_machine` puts in place of the
fixed figures of :class:`~dreampipe.machine.calibration.LocalCalibration`.
The all-reduce is the runtime's own
(:class:`~dreampipe.runtime.buckets.GradientBuckets`), behind a barrier; copies
are timed one rank at a time while the others compute (docs/design.md §9.1).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dreampipe.machine.timers import Timer, WallTimer
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runtime.buckets import GradientBuckets
from dreampipe.scheduling.actions import Action, ActionKind

__all__ = ["EVICT_BYTES", "HostRates", "compute_until_joined", "measure_rates",
           "with_host_rates"]

_ACTION = Action(ActionKind.ALLREDUCE, 0, 0)

#: The most timed rounds of each kind, however quick a round is.
_MAX_ROUNDS = 100

#: Bytes written before each timed step or copy, more than a server CPU's last-level
#: cache: in a run the forward and backward pass between two steps, so a step finds
#: its weights and gradients in memory, not in cache (steps timed back to back find
#: them in cache and run about twice as fast as in a run).
EVICT_BYTES = 64 << 20


@dataclass(frozen=True)
class HostRates:
    """Seconds of each timed round of ``nbytes`` of parameters among ``world`` ranks
    (no all-reduce rounds for one rank). The rates are over the mean round, not the
    median: a run pays every round, the slow ones too."""

    nbytes: int
    world: int
    allreduce_s: tuple[float, ...]
    step_s: tuple[float, ...]
    copy_s: tuple[float, ...]

    @property
    def allreduce_bandwidth(self) -> float:
        """Bytes/s at which a ring's ``2 (w-1)/w n`` bytes per rank take the mean time
        (infinite for one rank, which all-reduces nothing)."""
        if not self.allreduce_s:
            return math.inf
        ring = 2 * (self.world - 1) / self.world * self.nbytes
        return ring / statistics.fmean(self.allreduce_s)

    @property
    def step_bandwidth(self) -> float:
        """Parameter bytes one SGD step updates per second (the runtime's ``STEP``)."""
        return self.nbytes / statistics.fmean(self.step_s)

    @property
    def stash_copy_bandwidth(self) -> float:
        """Parameter bytes per second weight stashing's copy-on-write copies."""
        return self.nbytes / statistics.fmean(self.copy_s)


def measure_rates(
    params: Sequence[Tensor], *, rounds: int = 3, min_time_s: float = 0.1, group: Any = None,
    beside: Callable[[], Any] | None = None, timer: Timer | None = None,
) -> HostRates:
    """Time the all-reduce of ``params``' gradients over ``group``, an SGD step
    and a stash copy of them (not ``params`` themselves): one untimed round, then at
    least ``rounds`` filling ``min_time_s`` (the all-reduce's count agreed from the
    slowest rank's first round). Every rank of ``group`` (None: the default group) must
    call it with the same shapes.

    Steps are timed on every rank at once, as replicas and flushed stages step
    together. A stash copy is made by one stage while its neighbours compute,
    so with ``beside`` (a training round) the ranks time their copies in turn,
    each while the others run ``beside``: copies timed all at once contend for
    memory bandwidth as no stage's copy does in a run, and run far slower.

    ``timer`` (default: the wall clock) times each round: CUDA events for
    ``params`` on a GPU (:mod:`~dreampipe.machine.timers`).
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: time at least 1 round")
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    clock = timer or WallTimer()
    weights = [p.detach().clone() for p in params]
    device = weights[0].device if weights else torch.device("cpu")  # what the group reduces
    grads = [torch.ones_like(w) for w in weights]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    buckets = GradientBuckets(weights, group, _wait)
    optimizer = torch.optim.SGD(weights, lr=1e-6)
    for w, g in zip(weights, grads, strict=True):
        w.grad = g
    reduce_s: list[float] = []
    if world > 1:
        _allreduce_once(buckets, grads, clock)
        reduce_s.append(_allreduce_once(buckets, grads, clock))
        n = _agreed_rounds(reduce_s[0], rounds, min_time_s, group, device)
        reduce_s += [_allreduce_once(buckets, grads, clock) for _ in range(n - 1)]
    # floats written between rounds, as compute would, where the weights are
    cold = torch.empty(EVICT_BYTES // 4, device=device)
    step_s = _timed_cold(optimizer.step, rounds, min_time_s, cold, clock)
    turns = world if beside is not None else 1
    if turns > 1:  # the turns start together: every copy is timed beside the others' work
        dist.barrier(group)
    copy_s: tuple[float, ...] = ()
    for turn in range(turns):
        mine = turns == 1 or dist.get_rank(group) == turn
        if mine:
            copy_s = _timed_cold(lambda: _copy(weights), rounds, min_time_s, cold, clock)
        if beside is not None and turns > 1:
            compute_until_joined(beside, not mine, group, device)
    return HostRates(nbytes, world, tuple(reduce_s), step_s, copy_s)


def with_host_rates(graph: LayerGraph, rates: HostRates) -> LayerGraph:
    """``graph`` with ``rates`` in its meta (bytes/s), for
    :func:`~dreampipe.machine.calibration.measured_machine`; an all-reduce only among 2 or more."""
    meta: dict[str, Any] = {**graph.meta, "step_bandwidth": rates.step_bandwidth,
                            "stash_copy_bandwidth": rates.stash_copy_bandwidth}
    if rates.world > 1:
        meta["allreduce_bandwidth"] = rates.allreduce_bandwidth
    return replace(graph, meta=meta)


def _wait(work: Any, _action: Action) -> None:
    work.wait()


def _allreduce_once(buckets: GradientBuckets, grads: list[Tensor], timer: Timer) -> float:
    dist.barrier(buckets.group)
    return timer(lambda: buckets.finish(list(grads), _ACTION,
                                        1.0 / dist.get_world_size(buckets.group)))


def _agreed_rounds(
    first_s: float, rounds: int, min_time_s: float, group: Any, device: torch.device
) -> int:
    """The same round count on every rank: from the slowest rank's first round."""
    slowest = torch.tensor([first_s], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return _rounds_for(float(slowest.item()), rounds, min_time_s)


def _rounds_for(one_s: float, rounds: int, min_time_s: float) -> int:
    wanted = math.ceil(min_time_s / one_s) if one_s > 0 else rounds
    return max(rounds, min(_MAX_ROUNDS, wanted))


def _timed_cold(
    work: Callable[[], Any], rounds: int, min_time_s: float, cold: Tensor, timer: Timer
) -> tuple[float, ...]:
    """Seconds of each timed call of ``work``, after an untimed one: at least ``rounds``,
    and more until ``min_time_s`` has passed (at most :data:`_MAX_ROUNDS`), each after
    writing ``cold``, which evicts ``work``'s bytes from the caches."""
    work()
    took: list[float] = []
    begin = time.perf_counter()
    while len(took) < rounds or (len(took) < _MAX_ROUNDS
                                 and time.perf_counter() - begin < min_time_s):
        cold.fill_(len(took))
        took.append(timer(work))
    return tuple(took)


def compute_until_joined(
    work: Callable[[], Any], busy: bool, group: Any = None, device: torch.device | None = None
) -> None:
    """Every rank of ``group`` returns together; a ``busy`` one runs ``work`` until the
    others have joined (an asynchronous all-reduce completes by itself then, a gloo
    point-to-point receive only inside ``wait``). ``device``: where the group reduces
    (the rank's GPU under NCCL; the CPU by default)."""
    done = dist.all_reduce(torch.zeros(1, device=device), group=group, async_op=True)
    assert done is not None  # async_op gives the work
    while busy and not done.is_completed():
        work()
    done.wait()


def _copy(weights: list[Tensor]) -> None:
    for w in weights:  # StageModule.step's copy-on-write of a version still in use
        w.data = w.data.clone()

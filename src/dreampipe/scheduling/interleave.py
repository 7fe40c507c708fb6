"""Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): ``v`` stages per worker.

A model cut into ``p * v`` stages runs on ``p`` workers, stage ``s`` on worker
``s mod p`` (:func:`virtual_worker`), so each worker holds ``v``
non-adjacent chunks of the model. A microbatch visits every worker ``v``
times; the warm-up and drain each shrink to ``1/v`` of a chunk-sized 1F1B's,
which divides the bubble by about ``v``, for ``v`` times the sends.

Worker ``r`` of ``p`` runs, per minibatch of ``m`` microbatches (``m`` a
multiple of ``p``), the ``m * v`` chunk-microbatches in Megatron's order:
forward ``k`` is microbatch ``(k // pv) p + k mod p`` on chunk
``(k mod pv) // p``, backward ``k`` the same microbatch on chunk ``v - 1 -
(k mod pv) // p``; ``(p - r - 1) * 2 + (v - 1) * p`` forwards first, then
one forward and one backward at a time, then the backwards left.

:func:`interleaved_plan` cuts a layer chain into ``p * v`` stages of
balanced compute for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from dreampipe.errors import ScheduleError
from dreampipe.planning.interleave_order import chunk_of, warmup
from dreampipe.planning.placement import position_firsts
from dreampipe.planning.plan import Plan, Stage
from dreampipe.profiling.graph import LayerGraph
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind

__all__ = ["interleaved_compute", "interleaved_plan", "virtual_worker"]

_F, _B = ActionKind.FORWARD, ActionKind.BACKWARD


def virtual_worker(stage: int, num_stages: int, virtual_stages: int) -> int:
    """The worker of ``stage`` when ``num_stages`` stages share ``num_stages / v`` workers."""
    _check(num_stages, virtual_stages)
    return stage % (num_stages // virtual_stages)


def interleaved_compute(
    num_stages: int, virtual_stages: int, num_microbatches: int, microbatches_per_update: int
) -> Schedule:
    """Per-worker forward/backward order of interleaved 1F1B (module doc), unlowered."""
    _check(num_stages, virtual_stages)
    v, p, m = virtual_stages, num_stages // virtual_stages, microbatches_per_update
    if m % p:
        raise ScheduleError(
            f"interleaved-1f1b over {p} workers with {m} microbatches per minibatch; use a "
            f"multiple of {p} ({(m // p + 1) * p}), as Megatron-LM does"
        )
    actions = []
    for rank in range(p):
        acts: list[Action] = []
        for first in range(0, num_microbatches, m):
            acts += _worker_order(rank, p, v, m, first)
        actions.append(tuple(acts))
    return Schedule(ScheduleKind.INTERLEAVED, (1,) * num_stages, tuple(actions), num_microbatches,
                    microbatches_per_update, v)


def interleaved_plan(graph: LayerGraph, workers: int, virtual_stages: int,
                     positions: Sequence[int] | None = None) -> Plan:
    """``graph``'s layers cut into ``p * virtual_stages`` contiguous stages whose
    largest forward+backward time per replica is least (costs left at zero but
    ``compute_s`` and ``forward_s``). Stage ``s`` runs at position ``s mod p`` of the loop,
    on that position's ``positions[s mod p]`` replicas (default: ``workers`` positions of
    one), its ranks numbered position by position, as its ranks and the plan's
    ``virtual_stages`` say."""
    reps = [1] * workers if positions is None else list(positions)
    if sum(reps) != workers or min(reps, default=0) < 1:
        raise ScheduleError(f"positions {reps} for {workers} workers; give each position "
                            f"at least 1 replica, {workers} in all")
    p = len(reps)
    stages = p * virtual_stages
    if workers < 1 or virtual_stages < 1 or stages > len(graph):
        raise ScheduleError(
            f"{p} positions x {virtual_stages} virtual stages = {stages} stages for "
            f"{len(graph)} layers; give at most one stage per layer"
        )
    work = [0.0 if x.is_input else x.compute_ms / 1e3 for x in graph.layers]
    fwd = [0.0 if x.is_input else x.forward_ms / 1e3 for x in graph.layers]
    replicas = [reps[s % p] for s in range(stages)]
    bounds = _balanced_cuts(work, replicas)
    edges = [*bounds, len(work)]
    firsts = position_firsts(replicas, virtual_stages)
    out = tuple(
        Stage(first=edges[s], last=edges[s + 1] - 1, replicas=reps[s % p],
              ranks=tuple(range(firsts[s % p], firsts[s % p] + reps[s % p])),
              compute_s=sum(work[edges[s]:edges[s + 1]]),
              forward_s=sum(fwd[edges[s]:edges[s + 1]]))
        for s in range(stages))
    return Plan(stages=out, num_layers=len(work), batch_size=graph.batch_size,
                model=graph.model, layer_names=tuple(x.name for x in graph.layers),
                virtual_stages=virtual_stages)


def _balanced_cuts(work: list[float], shares: list[int]) -> list[int]:
    """First layers of ``len(shares)`` contiguous non-empty pieces minimising the largest
    sum over its share (piece ``k``'s replicas)."""
    n, parts = len(work), len(shares)
    prefix = [0.0]
    for x in work:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    # best[k][i]: least max over k pieces of layers 0..i-1; cut[k][i]: start of the last piece
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], (prefix[i] - prefix[j]) / shares[k - 1])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def _worker_order(rank: int, p: int, v: int, m: int, first: int) -> list[Action]:
    total = m * v

    def microbatch(k: int) -> int:
        return first + (k // (p * v)) * p + k % p

    def forward(k: int) -> Action:
        return Action(_F, chunk_of(k, p, v, True) * p + rank, microbatch(k))

    def backward(k: int) -> Action:
        return Action(_B, chunk_of(k, p, v, False) * p + rank, microbatch(k))

    first_backward = warmup(rank, p, v, m)
    acts = [forward(k) for k in range(first_backward)]
    for k in range(total - first_backward):
        acts += [forward(first_backward + k), backward(k)]
    acts += [backward(k) for k in range(total - first_backward, total)]
    return acts


def _check(num_stages: int, virtual_stages: int) -> None:
    if virtual_stages < 1 or num_stages % virtual_stages:
        raise ScheduleError(
            f"{num_stages} stages do not split into {virtual_stages} virtual stages per "
            f"worker; use a divisor of {num_stages}"
        )

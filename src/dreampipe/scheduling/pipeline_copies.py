"""Several stages a rank on replicated stages: copies of one pipeline, or replicated positions.

Megatron-LM and torchtitan run an interleaved (or V) pipeline with data
parallelism as ``r`` copies of the pipeline, each over its share of the
microbatches, every stage's replicas reducing their gradients once per update. In
dreampipe's terms every stage has ``r`` replicas; microbatch ``u`` runs on replica
``u mod r`` (1F1B-RR), so copy ``j`` runs update ``k``'s microbatches ``k m + j,
k m + j + r, ...``. :func:`copies_compute` writes each copy's order as the
unreplicated schedule of ``m / r`` microbatches an update, renumbered; rank ``q r +
j`` is position ``q`` of copy ``j`` (:class:`~dreampipe.scheduling.actions.Schedule`).
Where positions have different replica counts ``r_q`` (interleaved 1F1B, zbv),
:func:`positions_compute` gives replica ``j`` of position ``q`` the actions of the
unreplicated order of all ``m`` microbatches whose microbatch is ``j mod r_q``: a
subsequence of a deadlock-free order only waits less. The update pass then puts each
stage's ``ALLREDUCE<k>`` after the replica's last action of update ``k`` and before the
rank's first ``STEP<k>``, as for every synchronous schedule. :func:`check_copies`
refuses what neither can run. docs/design.md §7.7.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dreampipe.errors import ScheduleError
from dreampipe.planning.placement import position_replicas
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind, rank_firsts

__all__ = ["check_copies", "copies_compute", "positions_compute", "replicated_compute"]


def copies_compute(one_copy: Callable[[int, int], Schedule], replicas: int,
                   num_microbatches: int, microbatches_per_update: int) -> Schedule:
    """The unreplicated order ``one_copy(num_microbatches, microbatches_per_update)`` run
    by ``replicas`` copies, each over its own ``1 / replicas`` of every update's
    microbatches (module doc); both counts must be multiples of ``replicas``."""
    r, m = replicas, microbatches_per_update
    single = one_copy(num_microbatches // r, m // r)
    if r == 1:
        return single
    share = m // r

    def renumbered(u: int, copy: int) -> int:
        return (u // share) * m + (u % share) * r + copy

    actions = tuple(
        tuple(_moved(a, copy, renumbered) for a in acts)
        for acts in single.actions for copy in range(r))
    return Schedule(single.kind, (r,) * single.num_stages, actions, num_microbatches, m,
                    single.virtual_stages)


def replicated_compute(one_copy: Callable[[int, int], Schedule], replicas: Sequence[int],
                       num_microbatches: int, microbatches_per_update: int) -> Schedule:
    """:func:`copies_compute` where every stage has as many replicas, else
    :func:`positions_compute`."""
    if len(set(replicas)) > 1:
        return positions_compute(one_copy, replicas, num_microbatches, microbatches_per_update)
    return copies_compute(one_copy, replicas[0], num_microbatches, microbatches_per_update)


def positions_compute(one_copy: Callable[[int, int], Schedule], replicas: Sequence[int],
                      num_microbatches: int, microbatches_per_update: int) -> Schedule:
    """The unreplicated order ``one_copy(num_microbatches, microbatches_per_update)``, each
    position's actions dealt to its replicas round-robin by microbatch (module doc)."""
    single = one_copy(num_microbatches, microbatches_per_update)
    counts = position_replicas(replicas, single.virtual_stages, single.placement)
    actions = tuple(tuple(a for a in acts if a.microbatch % r == j)
                    for acts, r in zip(single.actions, counts, strict=True) for j in range(r))
    return Schedule(single.kind, tuple(replicas), actions, num_microbatches,
                    microbatches_per_update, single.virtual_stages)


def _moved(a: Action, copy: int, renumbered: Callable[[int, int], int]) -> Action:
    """``a`` of one copy with its microbatches renumbered for copy ``copy``."""
    if a.kind is ActionKind.OVERLAP:
        return Action(a.kind, a.stage, renumbered(a.microbatch, copy), a.backward_stage,
                      renumbered(a.backward_microbatch, copy))
    return Action(a.kind, a.stage, renumbered(a.microbatch, copy))


def check_copies(reps: Sequence[int], kind: ScheduleKind, microbatches_per_update: int,
                  virtual_stages: int) -> None:
    """Several stages a rank on replicated stages: every stage on as many replicas (``r``
    copies of the pipeline), each copy running a whole unreplicated schedule over its
    ``m / r`` microbatches of every update; or positions of different replica counts,
    each dealing the unreplicated order's ``m`` round-robin (:func:`positions_compute`)."""
    if len(set(reps)) != 1:
        _check_positions(reps, kind, microbatches_per_update, virtual_stages)
        return
    r, m, n = reps[0], microbatches_per_update, len(reps)
    need = {ScheduleKind.INTERLEAVED: n // virtual_stages}.get(kind, 1)
    if m % (r * need) or (kind is ScheduleKind.DUALPIPEV and m < r * n):
        fix = max(-(-m // (r * need)) * r * need,
                  r * n if kind is ScheduleKind.DUALPIPEV else 0)
        why = {ScheduleKind.INTERLEAVED: f"a multiple of the {need} ranks a copy",
               ScheduleKind.DUALPIPEV: f"at least one per stage ({n})"}.get(kind, "whole")
        raise ScheduleError(
            f"{kind.value} on {r} copies of the pipeline (replicas {list(reps)}) with {m} "
            f"microbatches per minibatch; each copy runs m / {r} of them, which must be "
            f"{why}: use {fix} (a multiple of {r * need}"
            + (f", at least {r * n}" if kind is ScheduleKind.DUALPIPEV else "") + ")")


def _check_positions(reps: Sequence[int], kind: ScheduleKind, microbatches_per_update: int,
                     virtual_stages: int) -> None:
    """Positions of different replica counts: interleaved 1F1B and zbv, not dualpipev
    (an overlapped pair's two microbatches may fall on different replicas); ``m`` what the
    unreplicated order takes (interleaving a multiple of the positions) times the lcm of
    the counts (every replica an equal share)."""
    rank_firsts(kind, tuple(reps), virtual_stages)  # every stage of a position alike
    counts = position_replicas(reps, virtual_stages, kind.placement)
    if kind is ScheduleKind.DUALPIPEV:
        raise ScheduleError(
            f"dualpipev with replicas {list(reps)}; an overlapped pair runs two microbatches "
            "on one rank, which replicas of different counts deal apart: give every stage "
            f"{min(reps)} (or {max(reps)}) replicas, or use zbv or interleaved-1f1b")
    each = len(counts) if kind is ScheduleKind.INTERLEAVED else 1
    m, need = microbatches_per_update, each * math.lcm(*counts)
    if m % need:
        lcm = math.lcm(*counts)
        order = (f"a multiple of its {each} positions, each's share a multiple of {lcm}"
                 if each > 1 else f"a multiple of {lcm}")
        raise ScheduleError(
            f"{kind.value} on {len(counts)} positions of {'-'.join(map(str, counts))} "
            f"replicas (replicas {list(reps)}) with {m} microbatches per minibatch; it needs "
            f"{order}, so that a position's replicas take equal shares round-robin: use "
            f"{-(-m // need) * need} (a multiple of {need})")

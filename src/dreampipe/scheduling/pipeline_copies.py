"""Several stages a rank on replicated stages: ``r`` copies of one pipeline.

Megatron-LM and torchtitan run an interleaved (or V) pipeline with data
parallelism as ``r`` copies of the pipeline, each over its share of the
microbatches, every stage's replicas reducing their gradients once per update. In
dreampipe's terms every stage has ``r`` replicas; microbatch ``u`` runs on replica
``u mod r`` (1F1B-RR), so copy ``j`` runs update ``k``'s microbatches ``k m + j,
k m + j + r, ...``. :func:`copies_compute` writes each copy's order as the
unreplicated schedule of ``m / r`` microbatches an update, renumbered; rank ``q r +
j`` is position ``q`` of copy ``j`` (:class:`~dreampipe.scheduling.actions.Schedule`).
The update pass then puts each stage's ``ALLREDUCE<k>`` after the copy's last action
of update ``k`` and before the rank's first ``STEP<k>``, as for every synchronous schedule.
:func:`check_copies` refuses uneven replica counts and microbatches a copy cannot split.
docs/design.md §7.7.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind

__all__ = ["check_copies", "copies_compute"]


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
    ``m / r`` microbatches of every update."""
    r, m, n = reps[0], microbatches_per_update, len(reps)
    if len(set(reps)) != 1:
        raise ScheduleError(
            f"{kind.value} with replicas {list(reps)}; several stages a rank run r copies "
            "of one pipeline, so every stage needs the same replica count: give each stage "
            f"{min(reps)} (or {max(reps)}) replicas, or use a schedule of one stage a rank")
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

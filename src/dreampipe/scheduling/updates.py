"""The update pass: where each rank's ``ALLREDUCE`` and ``STEP`` go in its list.

:func:`lower_updates` is the last pass of :func:`dreampipe.scheduling.build.
build_schedule`; it reads only the forward/backward order and the schedule's
kind (docs/design.md §7).
"""

from __future__ import annotations

from collections.abc import Sequence

from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind

__all__ = ["lower_updates"]

_B = ActionKind.BACKWARD


def lower_updates(schedule: Schedule) -> Schedule:
    """Add the weight updates: ``ALLREDUCE`` (replicated stages only) and ``STEP``.

    Both carry the update number ``k``, the all-reduce round of the stage's
    replicas; a rank that runs several stages updates each. PipeDream: after
    every backward ``B<u>`` (and its ``SEND_B``),
    ``STEP<k>`` with ``k = u // r`` on a stage of ``r`` replicas, preceded by
    ``ALLREDUCE<k>`` when ``r > 1``; a replica with no microbatch in the last,
    partial round joins its ``ALLREDUCE<k> STEP<k>`` at the end. Synchronous
    schedules: ``ALLREDUCE<k> STEP<k>`` once per minibatch k, after the rank's
    last action of it, even on a replica that ran none of its microbatches (it
    contributes zero gradient); a rank of several stages reduces them all, then
    steps them all (:func:`_rank_update`). 2bw: after each replica's last backward
    of the minibatch (module doc).
    """
    if schedule.kind is ScheduleKind.PIPEDREAM:
        return schedule.with_actions([_per_backward(schedule, schedule.stage_of_rank(rank), acts)
                                   for rank, acts in enumerate(schedule.actions)])
    if schedule.kind is ScheduleKind.TWO_BW:
        return schedule.with_actions([
            _per_last_backward(schedule, schedule.stage_of_rank(rank), acts)
            for rank, acts in enumerate(schedule.actions)])
    return schedule.with_actions([_per_update(schedule, schedule.stages_of_rank(rank), acts)
                               for rank, acts in enumerate(schedule.actions)])


def _per_backward(schedule: Schedule, stage: int, acts: tuple[Action, ...]) -> tuple[Action, ...]:
    """PipeDream: an update after each backward (and its ``SEND_B``), the k-th for
    the replica's k-th microbatch ``u`` (``k = u // r``); then the rounds the replica
    has no microbatch in (only the last, when it is partial), so that it still joins
    every all-reduce round of its stage."""
    r = schedule.replicas[stage]
    out: list[Action] = []
    pending: Action | None = None
    done = 0
    for a in acts:
        if pending is not None and not (a.kind is ActionKind.SEND_B
                                        and a.microbatch == pending.microbatch):
            done = pending.microbatch // r + 1
            out += _update_actions(schedule, stage, done - 1)
            pending = None
        out.append(a)
        if a.kind is _B:
            pending = a
    if pending is not None:
        done = pending.microbatch // r + 1
        out += _update_actions(schedule, stage, done - 1)
    for k in range(done, -(-schedule.num_microbatches // r)):
        out += _update_actions(schedule, stage, k)
    return tuple(out)


def _per_last_backward(schedule: Schedule, stage: int, acts: tuple[Action, ...]
                       ) -> tuple[Action, ...]:
    """2bw: update ``k`` after the replica's last backward of minibatch ``k`` (and its
    ``SEND_B``); every replica has one, the minibatch being a multiple of the replicas."""
    m, r = schedule.microbatches_per_update, schedule.replicas[stage]
    out: list[Action] = []
    pending: int | None = None
    for a in acts:
        if pending is not None and not (a.kind is ActionKind.SEND_B and a.microbatch == pending):
            out += _update_actions(schedule, stage, pending // m)
            pending = None
        out.append(a)
        if a.kind is _B and a.microbatch % m + r >= m:
            pending = a.microbatch
    if pending is not None:
        out += _update_actions(schedule, stage, pending // m)
    return tuple(out)


def _per_update(schedule: Schedule, stages: Sequence[int], acts: tuple[Action, ...]
                ) -> tuple[Action, ...]:
    m = schedule.microbatches_per_update
    out: list[Action] = []
    done = 0
    for a in acts:
        while a.microbatch // m > done:
            out += _rank_update(schedule, stages, done)
            done += 1
        out.append(a)
    while done < schedule.num_microbatches // m:
        out += _rank_update(schedule, stages, done)
        done += 1
    return tuple(out)


def _rank_update(schedule: Schedule, stages: Sequence[int], update: int) -> list[Action]:
    """Update ``update`` of a rank's ``stages``: every ``ALLREDUCE`` before the first
    ``STEP``, whose agreement (tied weights' sums, the global norm, the loss scale) reads
    the gradients of all the rank's stages summed over their replicas."""
    acts = [a for stage in stages for a in _update_actions(schedule, stage, update)]
    return sorted(acts, key=lambda a: a.kind is ActionKind.STEP)


def _update_actions(schedule: Schedule, stage: int, update: int) -> list[Action]:
    step = Action(ActionKind.STEP, stage, update)
    if schedule.replicas[stage] > 1:
        return [Action(ActionKind.ALLREDUCE, stage, update), step]
    return [step]

"""The update pass: where each rank's ``ALLREDUCE`` and ``STEP`` go in its list.

:func:`lower_updates` is the last pass of :func:`dreampipe.scheduling.build.
build_schedule`; it reads only the forward/backward order, the schedule's kind and
whether 2bw may defer a step (:func:`defers_steps`). A deferred ``STEP<k>`` leaves
its ``ALLREDUCE<k>`` in flight while minibatch ``k + 1`` runs on (it runs on the
weights before update ``k`` anyway); :func:`launched_rounds` names those all-reduces
for the runtime, the simulator and the memory walk (docs/design.md §7).
"""

from __future__ import annotations

from collections.abc import Sequence

from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind

__all__ = ["defers_steps", "launched_rounds", "lower_updates"]

_B, _F = ActionKind.BACKWARD, ActionKind.FORWARD
_COMPUTE = frozenset((ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT,
                      ActionKind.OVERLAP))


def defers_steps(kind: ScheduleKind, replicas: int, level: int, steps_agree: bool) -> bool:
    """Whether a stage's ``STEP<k>`` waits until its replica's last forward of minibatch
    ``k + 1``, its all-reduce overlapping that work: under 2bw, on a replicated stage
    whose gradients are whole (ZeRO below 2: level 2 reduce-scatters each microbatch's into
    the shards the next would share), where no rank waits for every other at each update
    (``steps_agree``: a loss scale changed at ``STEP<k>`` would meet gradients of
    minibatch ``k + 1`` taken at the old one)."""
    return kind is ScheduleKind.TWO_BW and replicas > 1 and level < 2 and not steps_agree


def launched_rounds(actions: Sequence[Action]) -> frozenset[tuple[int, int]]:
    """``(stage, k)`` of each ``ALLREDUCE<k>`` in a rank's ``actions`` that its ``STEP<k>``
    does not follow at once (a deferred step): it is launched and left in flight, and the
    ``STEP`` waits for it."""
    out: set[tuple[int, int]] = set()
    open_: set[tuple[int, int]] = set()
    for a in actions:
        key = (a.stage, a.microbatch)
        if a.kind is ActionKind.ALLREDUCE:
            open_.add(key)
        elif a.kind is ActionKind.STEP:
            open_.discard(key)
        elif a.kind in _COMPUTE:
            out |= open_
    return frozenset(out)


def lower_updates(schedule: Schedule, zero: Sequence[int] | None = None,
                  steps_agree: bool = False) -> Schedule:
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
    of the minibatch, its ``STEP`` after its last forward of the next where
    :func:`defers_steps` (``zero``: each stage's ZeRO level, None all 0).
    """
    if schedule.kind is ScheduleKind.PIPEDREAM:
        return schedule.with_actions([_per_backward(schedule, schedule.stage_of_rank(rank), acts)
                                   for rank, acts in enumerate(schedule.actions)])
    if schedule.kind is ScheduleKind.TWO_BW:
        levels = zero or (0,) * len(schedule.replicas)
        defer = [defers_steps(schedule.kind, r, lv, steps_agree)
                 for r, lv in zip(schedule.replicas, levels, strict=True)]
        out = []
        for rank, acts in enumerate(schedule.actions):
            stage = schedule.stage_of_rank(rank)
            lowered = _per_last_backward(schedule, stage, acts)
            out.append(_defer_steps(schedule, stage, lowered) if defer[stage] else lowered)
        return schedule.with_actions(out)
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


def _defer_steps(schedule: Schedule, stage: int, acts: tuple[Action, ...]
                 ) -> tuple[Action, ...]:
    """Each ``STEP<k>`` moved to just after the replica's last forward of minibatch ``k + 1``
    (and its ``SEND_F``), or left where it is when that forward came first, else moved to
    the end: before every action of minibatch ``k + 2``, and placed by minibatch ``k + 1``
    alone, so that a longer run's list begins with a shorter one's up to the actions of
    the minibatches only the longer has."""
    m, r = schedule.microbatches_per_update, schedule.replicas[stage]
    out: list[Action] = []
    waiting: dict[int, Action] = {}
    passed: set[int] = set()  # updates whose step's place has gone by
    last: Action | None = None  # the last forward of a minibatch, before its SEND_F
    for a in acts:
        if last is not None and not (a.kind is ActionKind.SEND_F
                                     and a.microbatch == last.microbatch):
            k = last.microbatch // m - 1
            out += [waiting.pop(k)] if k in waiting else []
            passed.add(k)
            last = None
        if a.kind is ActionKind.STEP and a.microbatch not in passed:
            waiting[a.microbatch] = a
            continue
        out.append(a)
        if a.kind is _F and a.microbatch % m + r >= m:
            last = a
    if last is not None:
        k = last.microbatch // m - 1
        out += [waiting.pop(k)] if k in waiting else []
    return tuple(out + sorted(waiting.values(), key=lambda a: a.microbatch))


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

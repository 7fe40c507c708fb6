"""The ZeRO-3 pass: where a sharded stage gathers its weights and where it frees them.

A replicated stage at ZeRO level 3 (:mod:`dreampipe.runtime.zero_params`) keeps only its
chunks of the weights between uses. :func:`place_unshards` puts, on every replica of such
a stage and for every update ``k``, ``UNSHARD<k>`` just before the rank's first
computation of update ``k``, moved ahead of the receive that feeds it, and ``RESHARD<k>``
(every weight freed) just after its last ``B`` or ``W`` of the update. Between them the
stage gathers per use where :func:`pairs_per_use` holds (every replica runs as many
microbatches in each update, so their gathers pair up), else all at ``UNSHARD<k>``. A
replica with no microbatch in update ``k`` still joins (a collective), with ``UNSHARD<k>
RESHARD<k>`` just before its ``ALLREDUCE<k>``. Only the synchronous schedules (one weight
version in use at a time) take it. docs/design.md §5.6.
"""

from __future__ import annotations

from collections.abc import Sequence

from dreampipe.errors import ScheduleError
from dreampipe.planning.zero_terms import SHARDED_LEVEL
from dreampipe.scheduling.actions import Action, ActionKind, Schedule

__all__ = ["ASYNC_REASON", "SHARDED_LEVEL", "pairs_per_use", "place_unshards", "sharded_stages",
           "unshard_problem"]

#: Why an asynchronous schedule cannot run a stage so sharded.
ASYNC_REASON = ("its microbatches in flight run on a weight version each, which a stage "
                "sharding its weights between uses cannot keep")

_K = ActionKind
_COMPUTE = frozenset((_K.FORWARD, _K.BACKWARD, _K.WEIGHT))
_MARKS = frozenset((_K.UNSHARD, _K.RESHARD))


def sharded_stages(schedule: Schedule, levels: Sequence[int]) -> frozenset[int]:
    """The stages of ``schedule`` whose weights ZeRO ``levels`` (one a stage) shard between
    uses: level 3 or more, on more than one replica."""
    if len(levels) != schedule.num_stages:
        raise ScheduleError(f"{len(levels)} ZeRO levels for {schedule.num_stages} stages; "
                            "give one a stage")
    return frozenset(s for s, (lv, r) in enumerate(zip(levels, schedule.replicas, strict=True))
                     if lv >= SHARDED_LEVEL and r > 1)


def pairs_per_use(schedule: Schedule, stage: int) -> bool:
    """Whether every replica of ``stage`` runs as many microbatches in each update, so
    that gathers made per use (each forward's and backward's, in the same order on every
    replica) pair up; otherwise a sharded stage gathers once per update."""
    m = schedule.microbatches_per_update
    counts: set[tuple[int, ...]] = set()
    for rank, acts in enumerate(schedule.actions):
        if schedule.stage_of_rank(rank) != stage:
            continue
        per: dict[int, int] = {}
        for a in acts:
            if a.kind is _K.FORWARD and a.stage == stage:
                per[a.microbatch // m] = per.get(a.microbatch // m, 0) + 1
        counts.add(tuple(per.get(k, 0) for k in range(schedule.num_microbatches // m)))
    return len(counts) <= 1


def place_unshards(schedule: Schedule, levels: Sequence[int]) -> Schedule:
    """``schedule`` with ``UNSHARD``/``RESHARD`` on the ranks of its ZeRO-3 stages (module
    docstring); ``levels`` gives each stage's ZeRO level. An asynchronous schedule with such
    a stage is a ScheduleError: its microbatches in flight run on several weight versions."""
    sharded = sharded_stages(schedule, levels)
    if not sharded:
        return schedule
    if not schedule.kind.synchronous:
        raise ScheduleError(
            f"ZeRO level 3 on stage {min(sharded)} with the {schedule.kind.value} schedule: "
            f"{ASYNC_REASON}; use zero=2, or a synchronous schedule")
    return schedule.with_actions([
        _placed(acts, schedule, stage) if (stage := schedule.stage_of_rank(rank)) in sharded
        else acts for rank, acts in enumerate(schedule.actions)])


def _placed(acts: tuple[Action, ...], schedule: Schedule, stage: int) -> tuple[Action, ...]:
    """One rank's list with a gather and a release around each update's computations."""
    m = schedule.microbatches_per_update
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    joins: dict[int, int] = {}
    for i, a in enumerate(acts):
        if a.kind in _COMPUTE:
            k = a.microbatch // m
            first.setdefault(k, i)
            last[k] = i
        elif a.kind is _K.ALLREDUCE:
            joins[a.microbatch] = i
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    for k in range(schedule.num_microbatches // m):
        gather, free = Action(_K.UNSHARD, stage, k), Action(_K.RESHARD, stage, k)
        if k in first:
            i = first[k]
            while i > 0 and acts[i - 1].kind is _K.RECV_F and acts[i - 1].microbatch // m == k:
                i -= 1  # gather while the input is on its way
            before.setdefault(i, []).append(gather)
            after.setdefault(last[k], []).append(free)
        else:  # no microbatch here: join the replicas' gather all the same
            at = joins.get(k, len(acts))
            before.setdefault(at, []).extend((gather, free))
    out: list[Action] = []
    for i, a in enumerate(acts):
        out += before.get(i, ())
        out.append(a)
        out += after.get(i, ())
    out += before.get(len(acts), ())
    return tuple(out)


def unshard_problem(schedule: Schedule) -> tuple[str, list[tuple[int, int]]] | None:
    """The first way ``schedule``'s ``UNSHARD``/``RESHARD`` actions break the rules, as a
    sentence and the ``(rank, step)`` cells to mark; None when they keep them. A stage with
    any of them is sharded: on each of its ranks they alternate ``UNSHARD<k> RESHARD<k>``,
    every replica joins the same gathers (collectives pair up by order), and every ``F``,
    ``B`` and ``W`` of update ``k`` lies between that update's pair."""
    sharded = {a.stage for acts in schedule.actions for a in acts if a.kind in _MARKS}
    if not sharded:
        return None
    joined: dict[int, tuple[int, frozenset[int]]] = {}
    for rank, acts in enumerate(schedule.actions):
        if schedule.stage_of_rank(rank) not in sharded:
            continue
        found = _rank_problem(schedule, rank, acts)
        if isinstance(found, tuple):
            return found
        stage = schedule.stage_of_rank(rank)
        first, rounds = joined.setdefault(stage, (rank, found))
        if rounds != found:
            k = min(rounds ^ found)
            has, lacks = (first, rank) if k in rounds else (rank, first)
            return (f"rank {has} gathers stage {stage}'s weights for update {k} (UNSHARD{k}) "
                    f"but rank {lacks}, a replica of the same stage, never does, so rank {has} "
                    f"would wait forever; add UNSHARD{k} RESHARD{k} to rank {lacks}",
                    [(lacks, len(schedule.actions[lacks]))])
    return None


def _rank_problem(schedule: Schedule, rank: int, acts: tuple[Action, ...]
                  ) -> tuple[str, list[tuple[int, int]]] | frozenset[int]:
    """One rank's problem (as :func:`unshard_problem`), or the updates it gathers for."""
    stage = schedule.stage_of_rank(rank)
    if not schedule.kind.synchronous or schedule.replicas[stage] < 2:
        step = next(i for i, a in enumerate(acts) if a.kind in _MARKS)
        why = (f"in the {schedule.kind.value} schedule {ASYNC_REASON}" if not
               schedule.kind.synchronous
               else f"stage {stage} has one replica, so there is nothing to gather")
        return f"rank {rank} runs {acts[step]}, but {why}; remove it", [(rank, step)]
    m, updates = schedule.microbatches_per_update, schedule.num_microbatches
    open_k: int | None = None
    opened_at = 0
    rounds: set[int] = set()
    for step, a in enumerate(acts):
        if a.kind is _K.UNSHARD:
            if open_k is not None or a.microbatch in rounds or not 0 <= a.microbatch < (
                    updates // m):
                return (f"rank {rank} runs {a} at step {step}, but "
                        + (f"UNSHARD{open_k} at step {opened_at} is not released yet; add "
                           f"RESHARD{open_k} before it" if open_k is not None else
                           f"it gathers for update {a.microbatch} again" if a.microbatch
                           in rounds else f"update {a.microbatch} is outside 0.."
                           f"{updates // m - 1}"), [(rank, step)])
            open_k, opened_at = a.microbatch, step
            rounds.add(a.microbatch)
        elif a.kind is _K.RESHARD:
            if open_k != a.microbatch:
                return (f"rank {rank} runs {a} at step {step} without UNSHARD{a.microbatch} "
                        "before it; a release follows its update's gather", [(rank, step)])
            open_k = None
        elif a.kind in _COMPUTE and open_k != a.microbatch // m:
            k = a.microbatch // m
            return (f"rank {rank} runs {a} of stage {stage} at step {step} with its weights "
                    f"sharded; put it between UNSHARD{k} and RESHARD{k}", [(rank, step)])
    if open_k is not None:
        return (f"rank {rank} never releases UNSHARD{open_k}; add RESHARD{open_k} after its "
                "last computation of the update", [(rank, opened_at)])
    return frozenset(rounds)

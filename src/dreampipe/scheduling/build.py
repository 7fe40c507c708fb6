"""The schedules of docs/design.md §7, built as data and lowered by passes.

:func:`build_schedule` is the one entry point. It runs three pure steps, then
:func:`~dreampipe.scheduling.validator.validate_schedule`::

    compute_schedule     per-rank F/B order            F0 F1 B0 F2 B1 B2
    lower_communication  + RECV before / SEND after   RECV_F0 F0 SEND_F0 ...
    lower_updates        + ALLREDUCE / STEP            ... B2 SEND_B2 STEP2
    place_unshards       + UNSHARD / RESHARD (ZeRO-3)  UNSHARD0 F0 ... B2 RESHARD0 ...

A replica of stage ``s`` runs its minibatches in flight
(:mod:`dreampipe.planning.in_flight`) before its first backward, then one
forward and one backward in turn, microbatch ``u`` on replica ``u mod replicas[s]``;
:mod:`.zero_bubble` and :mod:`.interleave` hold the other orders. Any number
of minibatches is a valid run: every replica joins a partial last round (§7.1).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

from dreampipe.errors import ScheduleError
from dreampipe.planning.in_flight import in_flight_counts
from dreampipe.planning.placement import Placement, rank_stages
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.interleave import interleaved_compute
from dreampipe.scheduling.pipeline_copies import check_copies, replicated_compute
from dreampipe.scheduling.unshard import place_unshards
from dreampipe.scheduling.updates import lower_updates
from dreampipe.scheduling.v_shape import v_shape_compute
from dreampipe.scheduling.zero_bubble import zero_bubble_counts, zero_bubble_order

__all__ = [
    "build_schedule",
    "compute_schedule",
    "forward_only",
    "lower_communication",
    "lower_updates",
    "repeat_schedule",
    "whole_rounds",
]

_F, _B = ActionKind.FORWARD, ActionKind.BACKWARD


def build_schedule(
    replicas: Sequence[int], kind: ScheduleKind, num_microbatches: int,
    microbatches_per_update: int = 1,
    in_flight: Sequence[int] | None = None, virtual_stages: int = 1,
    zero: Sequence[int] | None = None, steps_agree: bool = False,
) -> Schedule:
    """The validated schedule of ``kind`` for stages replicated ``replicas`` ways.

    ``num_microbatches`` minibatches (PipeDream) or microbatches (the synchronous
    schedules, ``microbatches_per_update`` per minibatch and weight update).
    ``in_flight`` gives PipeDream's minibatches in flight per stage (a plan's
    :attr:`~dreampipe.planning.plan.Plan.in_flight`; default
    :func:`~dreampipe.planning.in_flight.in_flight_counts`).
    ``virtual_stages`` (interleaved-1f1b, zbv, dualpipev) puts that many stages on each
    worker, the stages of a position on as many replicas (docs/design.md §7.7). ``zero``: each
    stage's ZeRO level (None: 0); a replicated stage at level 3 gathers and frees its weights where
    :func:`~dreampipe.scheduling.unshard.place_unshards` says. ``steps_agree``: every
    rank waits for every other at each update (clipping, a loss scale, skipping), which
    keeps 2bw's steps where they are (:func:`~dreampipe.scheduling.updates.defers_steps`).

    A synchronous schedule is its period (:func:`_period` updates), built and
    validated once, repeated with shifted microbatches: no microbatch crosses an update, so
    the repeat is what the passes would build, in time linear in the updates
    (a training loop extends its schedule as it goes).
    """
    _check(replicas, kind, num_microbatches, microbatches_per_update, in_flight, virtual_stages)
    levels = None if zero is None or not any(zero) else tuple(zero)
    if levels is not None and virtual_stages > 1 and any(
            r > 1 and level >= 3 for r, level in zip(replicas, levels, strict=True)):
        raise ScheduleError(
            f"ZeRO levels {list(levels)} with {virtual_stages} stages a rank on replicated "
            "stages; a rank gathers the weights of one stage only: use zero <= 2, or "
            "virtual_stages=1")
    if kind.synchronous:
        block = _period(replicas, microbatches_per_update) * microbatches_per_update
        if num_microbatches > block and num_microbatches % block == 0:
            return repeat_schedule(_period_block(tuple(replicas), kind, block,
                                                 microbatches_per_update, None, virtual_stages,
                                                 levels),
                                   num_microbatches // block)
    return _built(tuple(replicas), kind, num_microbatches, microbatches_per_update,
                  None if in_flight is None else tuple(in_flight), virtual_stages, levels,
                  steps_agree)


def _built(
    replicas: tuple[int, ...], kind: ScheduleKind, num_microbatches: int,
    microbatches_per_update: int,
    in_flight: tuple[int, ...] | None = None, virtual_stages: int = 1,
    zero: tuple[int, ...] | None = None, steps_agree: bool = False,
) -> Schedule:
    """The passes, then the validator."""
    from dreampipe.scheduling.validator import validate_schedule

    schedule = lower_updates(lower_communication(compute_schedule(
        replicas, kind, num_microbatches, microbatches_per_update, in_flight, virtual_stages)),
        zero, steps_agree)
    if zero is not None:
        schedule = place_unshards(schedule, zero)
    validate_schedule(schedule)
    return schedule


#: One period of a synchronous schedule, kept: small, immutable and asked for again
#: each time a training loop extends its schedule (whole runs are not kept: a
#: simulation's can take gigabytes).
_period_block = functools.lru_cache(maxsize=32)(_built)


def _period(replicas: Sequence[int], microbatches_per_update: int) -> int:
    """Updates after which a synchronous schedule repeats: stage ``s`` deals update
    ``k``'s microbatches to its replicas starting at ``k * microbatches_per_update mod r_s``."""
    return math.lcm(*(r // math.gcd(r, microbatches_per_update) for r in replicas))


def repeat_schedule(block: Schedule, times: int) -> Schedule:
    """``block`` run ``times`` times: microbatches shift by its microbatches, updates by its
    updates. ``block`` must end where no microbatch crosses into the next: whole updates of
    a synchronous schedule (a period, or a PyTorch schedule's one step)."""
    microbatches = block.num_microbatches
    updates = microbatches // block.microbatches_per_update
    actions = [
        tuple(a.shifted(j * microbatches, j * updates) for j in range(times) for a in acts)
        for acts in block.actions
    ]
    return Schedule(block.kind, block.replicas, tuple(actions), microbatches * times,
                    block.microbatches_per_update, block.virtual_stages)


def whole_rounds(replicas: Sequence[int], wanted: int) -> int:
    """The fewest PipeDream minibatches >= ``wanted`` that end on a whole all-reduce round.

    Replicas of a stage all-reduce once per round of ``replicas[s]`` microbatches; a
    multiple of the lcm of the replica counts makes every round of every stage
    whole. No schedule needs it (a run may end on a partial round,
    docs/design.md §7.1); training uses it so that each update averages the same
    number of minibatches. It can be huge for coprime counts (lcm(11, 13, 17,
    19) = 46189): do not use it to size a simulation.
    """
    lcm = math.lcm(*replicas)
    return -(-max(wanted, 1) // lcm) * lcm


def compute_schedule(
    replicas: Sequence[int], kind: ScheduleKind, num_microbatches: int,
    microbatches_per_update: int = 1,
    in_flight: Sequence[int] | None = None, virtual_stages: int = 1,
) -> Schedule:
    """Per-rank forward/backward order only, before any lowering pass.

    - PIPEDREAM: 1F1B over all microbatches after ``in_flight`` forwards per stage
      (:func:`build_schedule`), no flush.
    - FLUSH: the same per minibatch of ``microbatches_per_update`` microbatches,
      warm-up PipeDream's count (one all-reduce per minibatch: no join
      inside it to cover) capped by the microbatches a replica holds
      (PipeDream-Flush).
    - GPIPE: per minibatch all forwards in microbatch order, then all backwards in
      reverse microbatch order (the last microbatch's backward first, as GPipe does).
    - DP: one stage; each replica runs forward then backward of each microbatch.
    - NAIVE: forward then backward of each microbatch; a stage's next forward waits
      for the previous microbatch's gradient, so one microbatch at a time is in flight.
    - ZB_H1, ZB_H2: :mod:`~dreampipe.scheduling.zero_bubble`'s orders, with
      ``W`` actions.
    - INTERLEAVED: :func:`~dreampipe.scheduling.interleave.interleaved_compute`, on every
      copy of the pipeline where stages are replicated
      (:func:`~dreampipe.scheduling.pipeline_copies.copies_compute`), or dealt to each
      position's replicas where their counts differ (``positions_compute``).
    - TWO_BW: 1F1B over all microbatches with 1f1b-flush's warm-up, no flush.
    - ZBV, DUALPIPEV: :func:`~dreampipe.scheduling.v_shape.v_shape_compute`, 2 stages a
      rank in a V, on every copy likewise (zbv also on positions of different counts).
    """
    reps = _check(replicas, kind, num_microbatches, microbatches_per_update, in_flight,
                  virtual_stages)
    if kind is ScheduleKind.INTERLEAVED:
        return replicated_compute(functools.partial(interleaved_compute, len(reps),
                                                    virtual_stages),
                                  reps, num_microbatches, microbatches_per_update)
    if kind.placement is Placement.V:
        return replicated_compute(functools.partial(v_shape_compute, kind, len(reps)), reps,
                                  num_microbatches, microbatches_per_update)
    per_update = (num_microbatches if kind in (ScheduleKind.PIPEDREAM, ScheduleKind.TWO_BW)
                  else microbatches_per_update)
    order = _ORDERS[kind]
    warmup = (tuple(in_flight) if in_flight is not None else in_flight_counts(reps)
              ) if kind is ScheduleKind.PIPEDREAM else in_flight_counts(reps, 0, aligned=False)
    if kind.splits_backward:
        warmup, defer = zero_bubble_counts(kind, warmup)
        order = functools.partial(_zero_bubble, defer)
    actions: list[tuple[Action, ...]] = []
    for stage, r in enumerate(reps):
        for replica in range(r):
            acts: list[Action] = []
            for first in range(0, num_microbatches, per_update):
                microbatches = list(range(first + (replica - first) % r, first + per_update, r))
                acts += order(microbatches, warmup[stage], stage)
            actions.append(tuple(acts))
    return Schedule(kind, reps, tuple(actions), num_microbatches, microbatches_per_update)


def forward_only(replicas: Sequence[int], num_microbatches: int,
                 virtual_stages: int = 1, kind: ScheduleKind = ScheduleKind.GPIPE) -> Schedule:
    """Forwards alone (evaluation): each replica runs its microbatches in order, round-robin.

    GPipe's schedule of one update over ``num_microbatches`` microbatches with its
    backward, gradient and update actions left out. With ``virtual_stages``
    ``v`` > 1 (stages placed as ``kind`` places them: pass the training schedule's; on
    a replicated position, replica ``j`` of each), a rank runs its stages one after
    another, each over its microbatches: a rank waits only on stages before its own, so
    no two wait on each other.
    """
    full = build_schedule(replicas, ScheduleKind.GPIPE, num_microbatches, num_microbatches)
    keep = (ActionKind.RECV_F, _F, ActionKind.SEND_F)
    lists = [tuple(a for a in acts if a.kind in keep) for acts in full.actions]
    if virtual_stages == 1:
        return full.with_actions(lists)
    n = len(replicas)
    kind = kind if kind.placement is Placement.V else ScheduleKind.GPIPE
    return Schedule(kind, full.replicas, tuple(
        tuple(a for s in rank_stages(q, n, virtual_stages, kind.placement)
              for a in lists[full.first_rank(s) + j])
        for q in range(n // virtual_stages) for j in range(replicas[q])), num_microbatches,
        num_microbatches, virtual_stages)


def lower_communication(schedule: Schedule) -> Schedule:
    """Add ``RECV_F`` before each forward and ``SEND_F`` after it (except at the
    ends of the pipeline), ``RECV_B`` before each backward and ``SEND_B`` after.
    """
    last = schedule.num_stages - 1
    out: list[tuple[Action, ...]] = []
    for acts in schedule.actions:
        lowered: list[Action] = []
        for a in acts:
            s, u = a.stage, a.microbatch
            if a.kind is ActionKind.OVERLAP:  # both receives first, both sends after
                f, b = a.parts
                lowered += _receives(f, last) + _receives(b, last) + [a] + _sends(
                    f, last) + _sends(b, last)
            elif a.kind is _F:
                if s > 0:
                    lowered.append(Action(ActionKind.RECV_F, s, u))
                lowered.append(a)
                if s < last:
                    lowered.append(Action(ActionKind.SEND_F, s, u))
            elif a.kind is _B:
                if s < last:
                    lowered.append(Action(ActionKind.RECV_B, s, u))
                lowered.append(a)
                if s > 0:
                    lowered.append(Action(ActionKind.SEND_B, s, u))
            else:
                lowered.append(a)
        out.append(tuple(lowered))
    return schedule.with_actions(out)


def _receives(a: Action, last: int) -> list[Action]:
    """What a forward or backward part of an overlapped pair receives before it."""
    if a.kind is _F:
        return [Action(ActionKind.RECV_F, a.stage, a.microbatch)] if a.stage > 0 else []
    return [Action(ActionKind.RECV_B, a.stage, a.microbatch)] if a.stage < last else []


def _sends(a: Action, last: int) -> list[Action]:
    """What a forward or backward part of an overlapped pair sends after it."""
    if a.kind is _F:
        return [Action(ActionKind.SEND_F, a.stage, a.microbatch)] if a.stage < last else []
    return [Action(ActionKind.SEND_B, a.stage, a.microbatch)] if a.stage > 0 else []


# ---- per-minibatch orders of one replica -----------------------------------
def _one_f_one_b(microbatches: list[int], warmup: int, stage: int) -> list[Action]:
    w = min(warmup, len(microbatches))
    acts = [Action(_F, stage, u) for u in microbatches[:w]]
    for j, u in enumerate(microbatches):
        acts.append(Action(_B, stage, u))
        if j + w < len(microbatches):
            acts.append(Action(_F, stage, microbatches[j + w]))
    return acts


def _all_forward_all_backward(microbatches: list[int], _warmup: int, stage: int) -> list[Action]:
    return ([Action(_F, stage, u) for u in microbatches]
            + [Action(_B, stage, u) for u in reversed(microbatches)])


def _one_at_a_time(microbatches: list[int], _warmup: int, stage: int) -> list[Action]:
    return [Action(k, stage, u) for u in microbatches for k in (_F, _B)]


def _zero_bubble(defer: Sequence[int], microbatches: list[int], warmup: int, stage: int
                 ) -> list[Action]:
    return zero_bubble_order(microbatches, warmup, defer[stage], stage)


_ORDERS: dict[ScheduleKind, Callable[[list[int], int, int], list[Action]]] = {
    ScheduleKind.PIPEDREAM: _one_f_one_b,
    ScheduleKind.FLUSH: _one_f_one_b,
    ScheduleKind.GPIPE: _all_forward_all_backward,
    ScheduleKind.DP: _one_at_a_time,
    ScheduleKind.NAIVE: _one_at_a_time,
    ScheduleKind.ZB_H1: _one_f_one_b,
    ScheduleKind.ZB_H2: _one_f_one_b,
    ScheduleKind.TWO_BW: _one_f_one_b,
}


def _check(
    replicas: Sequence[int], kind: ScheduleKind, num_microbatches: int,
    microbatches_per_update: int,
    in_flight: Sequence[int] | None, virtual_stages: int = 1,
) -> tuple[int, ...]:
    reps = tuple(int(r) for r in replicas)
    if not reps or any(r < 1 for r in reps):
        raise ScheduleError(
            f"replicas {list(replicas)} must list at least one stage, each with >= 1 replica"
        )
    if in_flight is not None and (kind is not ScheduleKind.PIPEDREAM or len(in_flight) != len(
            reps) or any(w < 1 for w in in_flight)):
        raise ScheduleError(
            f"in_flight={list(in_flight)} with the {kind.value} schedule of {len(reps)} stages; "
            "give one count >= 1 per stage, and only to the pipedream schedule"
        )
    if num_microbatches < 1:
        raise ScheduleError(f"{num_microbatches} microbatches to run; run at least 1")
    if microbatches_per_update < 1:
        raise ScheduleError(f"microbatches_per_update={microbatches_per_update}; use 1 or more")
    if num_microbatches % microbatches_per_update:
        fix = (num_microbatches // microbatches_per_update + 1) * microbatches_per_update
        raise ScheduleError(
            f"{num_microbatches} microbatches do not split into minibatches of "
            f"{microbatches_per_update}; "
            f"run {fix} microbatches or change the microbatches per minibatch"
        )
    if kind is ScheduleKind.PIPEDREAM and microbatches_per_update != 1:
        raise ScheduleError(
            f"microbatches_per_update={microbatches_per_update} with the pipedream schedule, "
            "which updates after every minibatch; use 1, or the 1f1b-flush schedule for "
            "microbatches"
        )
    several = kind is ScheduleKind.INTERLEAVED or kind.placement is Placement.V
    if virtual_stages != 1 and not several:
        raise ScheduleError(
            f"virtual_stages={virtual_stages} with the {kind.value} schedule; only "
            "interleaved-1f1b, zbv and dualpipev run several stages per worker: use 1, or "
            "one of them"
        )
    if kind.placement is Placement.V and virtual_stages != 2:
        raise ScheduleError(
            f"{kind.value} with virtual_stages={virtual_stages}; it runs 2 stages on each "
            "worker, in a V: give virtual_stages=2 (and an even number of stages)"
        )
    if several and max(reps) > 1:
        check_copies(reps, kind, microbatches_per_update, virtual_stages)
    if kind is ScheduleKind.TWO_BW and microbatches_per_update % math.lcm(*reps):
        raise ScheduleError(
            f"2bw with {microbatches_per_update} microbatches per minibatch over replicas "
            f"{list(reps)}; use a multiple of {math.lcm(*reps)} so that every replica "
            "joins every all-reduce with its own microbatches"
        )
    if kind is ScheduleKind.DP:
        if len(reps) != 1:
            raise ScheduleError(
                f"the dp schedule runs one stage, got replicas {list(reps)}; "
                f"use replicas ({sum(reps)},)"
            )
        if microbatches_per_update % reps[0]:
            raise ScheduleError(
                f"dp over {reps[0]} workers with {microbatches_per_update} microbatches per "
                "update; "
                f"use a multiple of {reps[0]} so every worker gets the same share"
            )
    return reps


"""Check a schedule before anything runs it.

:func:`validate_schedule` checks, in order: every action sits on a rank of its
stage; each microbatch's forward, backward and weight gradient run once per stage,
on the rank round-robin names, in order; every replica of a stage joins the
same all-reduce rounds, each once; a ZeRO-3 stage's replicas join the same
``UNSHARD`` gathers, and each of its computations lies between the ``UNSHARD``
and the ``RESHARD`` of its update (:mod:`.unshard`); data arrives before it is
used; every send has exactly one receive; and a dry run on
:class:`dreampipe.scheduling.stepping.Stepper`, the core the simulator times,
terminates. An overlapped pair (``OVERLAP_F_B``) is checked as its two
computations at its step. A failure raises :class:`ScheduleError` with the rank-by-step
grid around the offending action, marked ``>F3<``. The invariants and an example
grid: docs/design.md §8.3.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import ActionKind, Schedule, TransferKey
from dreampipe.scheduling.stepping import Stepper
from dreampipe.scheduling.unshard import unshard_problem

__all__ = ["format_grid", "validate_schedule"]

_K = ActionKind
# Module constants for the loops over every action: an Enum member looked up
# on its class costs more than the rest of a step (Python 3.11).
_F, _B, _W, _ALLREDUCE = _K.FORWARD, _K.BACKWARD, _K.WEIGHT, _K.ALLREDUCE
_OVERLAP = _K.OVERLAP
# On one rank, `earlier<u>` must come before `later<u>`: later -> earlier kinds.
_EARLIER = {
    _K.FORWARD: (_K.RECV_F,),
    _K.SEND_F: (_K.FORWARD,),
    _K.BACKWARD: (_K.FORWARD, _K.RECV_B),
    _K.SEND_B: (_K.BACKWARD,),
    _K.WEIGHT: (_K.BACKWARD,),
}
_WINDOW = 8


def validate_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` with a marked grid if ``schedule`` is unsound."""
    _check_stages(schedule)
    _check_microbatches(schedule)
    _check_allreduces(schedule)
    _check_unshards(schedule)
    _check_order(schedule)
    _check_pairs(schedule)
    _dry_run(schedule)


def format_grid(schedule: Schedule, marks: Sequence[tuple[int, int]] = ()) -> str:
    """The rank-by-step grid; ``marks`` are ``(rank, step)`` cells shown ``>X<``.

    Only the steps around the first mark are shown (all of them when short).
    """
    width = max((len(a) for a in schedule.actions), default=0)
    centre = min((step for _, step in marks), default=0)
    lo = max(0, centre - _WINDOW)
    hi = min(width, max(centre, max((s for _, s in marks), default=0)) + _WINDOW + 1)
    marked = set(marks)
    cells: list[list[str]] = []
    for rank, acts in enumerate(schedule.actions):
        row = []
        for step in range(lo, hi):
            text = str(acts[step]) if step < len(acts) else ""
            row.append(f">{text or '(end)'}<" if (rank, step) in marked else text)
        cells.append(row)
    widths = [max([len(str(lo + j))] + [len(r[j]) for r in cells]) for j in range(hi - lo)]
    heads = [f"rank {r} s{','.join(map(str, schedule.stages_of_rank(r)))}"
             for r in range(schedule.num_ranks)]
    left = max(len(h) for h in heads)
    lines = ["step".ljust(left) + "  " + "  ".join(
        str(lo + j).ljust(w) for j, w in enumerate(widths))]
    if lo > 0:
        lines[0] += f"  (steps {lo}..{hi - 1} of {width})"
    for head, row in zip(heads, cells, strict=True):
        lines.append(head.ljust(left) + "  " + "  ".join(
            c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _fail(schedule: Schedule, sentence: str, marks: Sequence[tuple[int, int]]) -> ScheduleError:
    return ScheduleError(f"{sentence}\n{format_grid(schedule, marks)}")


def _check_stages(schedule: Schedule) -> None:
    for rank, acts in enumerate(schedule.actions):
        stages = schedule.stages_of_rank(rank)
        for step, a in enumerate(acts):
            for part in a.parts:
                if part.stage not in stages:
                    held = "stage " + ", ".join(map(str, stages))
                    raise _fail(schedule, f"rank {rank} holds {held} but action {a} at step "
                                f"{step} is for stage {part.stage}; move it to a rank of stage "
                                f"{part.stage}", [(rank, step)])


def _check_microbatches(schedule: Schedule) -> None:
    split = schedule.kind.splits_backward
    computes = (_F, _B, _W) if split else (_F, _B)
    where: dict[tuple[ActionKind, int, int], tuple[int, int]] = {}
    for rank, acts in enumerate(schedule.actions):
        for step, whole in enumerate(acts):
            for a in whole.parts if whole.kind is _OVERLAP else (whole,):
                k = a.kind
                if not (k is _F or k is _B or k is _W):
                    continue
                if k is _W and not split:
                    raise _fail(schedule, f"{a} in the {schedule.kind.value} schedule, whose "
                                "backward computes the weight gradient; remove it, or use "
                                "zb-h1, zb-h2, zbv or dualpipev", [(rank, step)])
                key = (k, a.stage, a.microbatch)
                if key in where:
                    raise _fail(schedule, f"{a} runs 2 times at stage {a.stage}; each microbatch "
                                "runs once per stage", [where[key], (rank, step)])
                where[key] = (rank, step)
    for (kind, stage, microbatch), (rank, step) in where.items():
        name = f"{kind.value}{microbatch}"
        if not 0 <= microbatch < schedule.num_microbatches:
            raise _fail(schedule, f"{name} at stage {stage} is outside microbatches "
                        f"0..{schedule.num_microbatches - 1}", [(rank, step)])
        owner = schedule.rank_of(stage, microbatch)
        if rank != owner:
            raise _fail(schedule, f"{name} of stage {stage} is on rank {rank} but round robin "
                        f"puts microbatch {microbatch} on rank {owner}", [(rank, step)])
    if len(where) != len(computes) * schedule.num_stages * schedule.num_microbatches:
        for stage in range(schedule.num_stages):
            for kind in computes:
                for microbatch in range(schedule.num_microbatches):
                    if (kind, stage, microbatch) not in where:
                        owner = schedule.rank_of(stage, microbatch)
                        raise _fail(schedule, f"{kind.value}{microbatch} of stage "
                                    f"{stage} is missing; add it to rank {owner}",
                                    [(owner, len(schedule.actions[owner]))])


def _check_allreduces(schedule: Schedule) -> None:
    """A rank joins each all-reduce round once, and its stage's replicas join the same
    rounds: collectives pair up by order at run time, so a round some replica
    skips would hang the others (or pair them with a later round)."""
    rounds: list[dict[tuple[int, int], int]] = []
    for rank, acts in enumerate(schedule.actions):
        seen: dict[tuple[int, int], int] = {}
        for step, a in enumerate(acts):
            if a.kind is not _ALLREDUCE:
                continue
            rnd, key = a.allreduce_round, (a.stage, a.allreduce_round)
            if key in seen:
                raise _fail(schedule, f"rank {rank} joins all-reduce round {rnd} of stage "
                            f"{a.stage} 2 times ({a} at steps {seen[key]} and {step}); its "
                            "replicas would pair it with a later round and hang: remove one",
                            [(rank, seen[key]), (rank, step)])
            seen[key] = step
        rounds.append(seen)
    for rank in range(schedule.num_ranks):
        stage = schedule.stage_of_rank(rank)
        first = schedule.first_rank(stage)
        differ = rounds[first].keys() ^ rounds[rank].keys()
        if differ:
            stage, rnd = min(differ)
            has, lacks = (first, rank) if (stage, rnd) in rounds[first] else (rank, first)
            raise _fail(schedule, f"rank {has} joins all-reduce round {rnd} of stage {stage} "
                        f"but rank {lacks}, a replica of the same stage, never does, so rank "
                        f"{has} would wait forever; add ALLREDUCE{rnd} STEP{rnd} to rank {lacks} "
                        "(a replica with no microbatch in the round joins with no gradient)",
                        [(has, rounds[has][stage, rnd]), (lacks, len(schedule.actions[lacks]))])


def _check_unshards(schedule: Schedule) -> None:
    problem = unshard_problem(schedule)
    if problem is not None:
        raise _fail(schedule, *problem)


def _check_order(schedule: Schedule) -> None:
    last = schedule.num_stages - 1
    for rank, acts in enumerate(schedule.actions):
        parts = [(step, a) for step, whole in enumerate(acts)
                 for a in (whole.parts if whole.kind is _OVERLAP else (whole,))]
        pos = {(a.kind, a.stage, a.microbatch): step for step, a in parts}
        for step, a in parts:
            for earlier in _EARLIER.get(a.kind, ()):
                before = pos.get((earlier, a.stage, a.microbatch))
                if before is None:
                    if _needed(earlier, a.kind, a.stage, last):
                        raise _fail(schedule, f"rank {rank} runs {a} without {earlier.value}"
                                    f"{a.microbatch}; add it before step {step}", [(rank, step)])
                elif before > step:
                    raise _fail(schedule, f"rank {rank} runs {a} at step {step} before "
                                f"{earlier.value}{a.microbatch} at step {before}; swap them",
                                [(rank, step), (rank, before)])


def _needed(earlier: ActionKind, later: ActionKind, stage: int, last: int) -> bool:
    if earlier is _K.RECV_F:
        return stage > 0
    if earlier is _K.RECV_B:
        return stage < last
    return later is _K.BACKWARD or later is _K.WEIGHT


def _check_pairs(schedule: Schedule) -> None:
    sends: list[TransferKey] = []
    recvs: list[TransferKey] = []
    last = schedule.num_stages - 1
    for rank, acts in enumerate(schedule.actions):
        for step, a in enumerate(acts):
            key = a.transfer_key
            if key is None:
                continue
            owner = schedule.rank_of(a.stage, a.microbatch)
            if rank != owner:
                raise _fail(schedule, f"{a} of stage {a.stage} is on rank {rank} but round "
                            f"robin puts microbatch {a.microbatch} on rank {owner}; move it",
                            [(rank, step)])
            if a.stage == 0 or a.stage == last:
                _check_peer_stage(schedule, rank, step)
            (sends if a.is_send else recvs).append(key)
    sent, received = Counter(sends), Counter(recvs)
    if dict.__eq__(sent, received):  # plain dict comparison, in C
        return
    key = next(k for k in sent.keys() | received.keys() if sent[k] != received[k])
    backward, stage, microbatch = key
    what = "B" if backward else "F"
    src = schedule.rank_of(stage, microbatch)
    dst = schedule.rank_of(stage + (-1 if backward else 1), microbatch)
    where = [(rank, step) for rank, acts in enumerate(schedule.actions)
             for step, a in enumerate(acts) if a.transfer_key == key]
    raise _fail(schedule, f"rank {src} sends {what}{microbatch} to rank {dst} {sent[key]} "
                f"time(s) but rank {dst} receives it {received[key]} time(s); every "
                f"SEND_{what} needs exactly one RECV_{what} on its peer", where)


def _check_peer_stage(schedule: Schedule, rank: int, step: int) -> None:
    a, last = schedule.actions[rank][step], schedule.num_stages - 1
    towards = a.peer_stage
    if towards is not None and not 0 <= towards <= last:
        raise _fail(schedule, f"rank {rank} (stage {a.stage}) runs {a}, which talks to "
                    f"stage {towards} outside 0..{last}; remove it", [(rank, step)])


def _dry_run(schedule: Schedule) -> None:
    """Step every rank in zero time (:class:`Stepper`); ranks left blocked deadlock."""
    stepper = Stepper(schedule)
    stuck = stepper.run()
    if stuck:
        acts, pc = schedule.actions, stepper.position
        parts = [f"rank {r} waits at {acts[r][pc[r]]}" for r in stuck[:6]]
        raise _fail(schedule, "deadlock: " + ", ".join(parts) + (
            ", ..." if len(stuck) > 6 else "") + "; no rank can move (each waits for a send "
            "or all-reduce that comes later on another rank); reorder the actions",
            [(r, pc[r]) for r in stuck])

"""Check a schedule before anything runs it.

:func:`validate` checks, in order: every action sits on a rank of its stage;
each unit's forward and backward run exactly once per stage, on the rank
``Schedule.rank_of`` names, forward first; a rank joins each all-reduce round
once; data arrives before it is used
(``RECV_F<u>`` before ``F<u>``, ``F<u>`` before ``SEND_F<u>``, likewise for
backward); every send has exactly one receive on its peer; and a dry run in
the runtime's semantics terminates (receives and all-reduces block, sends and
compute never do). A failure raises :class:`ScheduleError` with the rank-by-step
grid around the offending action, marked ``>F3<``::

    deadlock: rank 0 waits at RECV_B0, rank 1 waits at RECV_F0; no rank can move ...
    step       0          1          2        3        4
    rank 0 s0  F0         >RECV_B0<  SEND_F0  B0       STEP0
    rank 1 s1  >RECV_F0<  F0         B0       SEND_B0  STEP0
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import Action, ActionKind, Schedule

__all__ = ["format_grid", "validate_schedule"]

_K = ActionKind
# On one rank, `earlier<u>` must come before `later<u>`: later -> earlier kinds.
_EARLIER = {
    _K.FORWARD: (_K.RECV_F,),
    _K.SEND_F: (_K.FORWARD,),
    _K.BACKWARD: (_K.FORWARD, _K.RECV_B),
    _K.SEND_B: (_K.BACKWARD,),
}
# kind -> (1 if gradient, offset to the sending stage, is a send, offset to the peer stage)
_TRANSFER = {
    _K.SEND_F: (0, 0, True, 1),
    _K.RECV_F: (0, -1, False, -1),
    _K.SEND_B: (1, 0, True, -1),
    _K.RECV_B: (1, 1, False, 1),
}
_WINDOW = 8


def validate_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` with a marked grid if ``schedule`` is unsound."""
    _check_stages(schedule)
    _check_units(schedule)
    _check_allreduces(schedule)
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
    heads = [f"rank {r} s{schedule.stage_of_rank(r)}" for r in range(schedule.num_ranks)]
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
        stage = schedule.stage_of_rank(rank)
        for step, a in enumerate(acts):
            if a.stage != stage:
                raise _fail(schedule, f"rank {rank} holds stage {stage} but action {a} at step "
                            f"{step} is for stage {a.stage}; move it to a rank of stage "
                            f"{a.stage}", [(rank, step)])


def _check_units(schedule: Schedule) -> None:
    where: dict[tuple[bool, int, int], tuple[int, int]] = {}
    for rank, acts in enumerate(schedule.actions):
        for step, a in enumerate(acts):
            k = a.kind
            if k is _K.FORWARD or k is _K.BACKWARD:
                key = (k is _K.FORWARD, a.stage, a.unit)
                if key in where:
                    raise _fail(schedule, f"{a} runs 2 times at stage {a.stage}; each unit "
                                "runs once per stage", [where[key], (rank, step)])
                where[key] = (rank, step)
    for (forward, stage, unit), (rank, step) in where.items():
        name = f"{'F' if forward else 'B'}{unit}"
        if not 0 <= unit < schedule.num_units:
            raise _fail(schedule, f"{name} at stage {stage} is outside units "
                        f"0..{schedule.num_units - 1}", [(rank, step)])
        owner = schedule.rank_of(stage, unit)
        if rank != owner:
            raise _fail(schedule, f"{name} of stage {stage} is on rank {rank} but round robin "
                        f"puts unit {unit} on rank {owner}", [(rank, step)])
    if len(where) != 2 * schedule.num_stages * schedule.num_units:
        for stage in range(schedule.num_stages):
            for forward in (True, False):
                for unit in range(schedule.num_units):
                    if (forward, stage, unit) not in where:
                        owner = schedule.rank_of(stage, unit)
                        raise _fail(schedule, f"{'F' if forward else 'B'}{unit} of stage "
                                    f"{stage} is missing; add it to rank {owner}",
                                    [(owner, len(schedule.actions[owner]))])


def _check_allreduces(schedule: Schedule) -> None:
    """A rank joins each all-reduce round once: collectives pair up by order at run time."""
    for rank, acts in enumerate(schedule.actions):
        seen: dict[int, int] = {}
        for step, a in enumerate(acts):
            if a.kind is not _K.ALLREDUCE:
                continue
            rnd = schedule.allreduce_round(a)
            if rnd in seen:
                raise _fail(schedule, f"rank {rank} joins all-reduce round {rnd} of stage "
                            f"{a.stage} 2 times ({a} at steps {seen[rnd]} and {step}); its "
                            "replicas would pair it with a later round and hang: remove one",
                            [(rank, seen[rnd]), (rank, step)])
            seen[rnd] = step


def _check_order(schedule: Schedule) -> None:
    last = schedule.num_stages - 1
    for rank, acts in enumerate(schedule.actions):
        pos = {(a.kind, a.unit): step for step, a in enumerate(acts)}
        for step, a in enumerate(acts):
            for earlier in _EARLIER.get(a.kind, ()):
                before = pos.get((earlier, a.unit))
                if before is None:
                    if _needed(earlier, a.kind, a.stage, last):
                        raise _fail(schedule, f"rank {rank} runs {a} without {earlier.value}"
                                    f"{a.unit}; add it before step {step}", [(rank, step)])
                elif before > step:
                    raise _fail(schedule, f"rank {rank} runs {a} at step {step} before "
                                f"{earlier.value}{a.unit} at step {before}; swap them",
                                [(rank, step), (rank, before)])


def _needed(earlier: ActionKind, later: ActionKind, stage: int, last: int) -> bool:
    if earlier is _K.RECV_F:
        return stage > 0
    if earlier is _K.RECV_B:
        return stage < last
    return later is _K.BACKWARD


def _check_pairs(schedule: Schedule) -> None:
    sends: list[tuple[int, int, int]] = []
    recvs: list[tuple[int, int, int]] = []
    last = schedule.num_stages - 1
    for rank, acts in enumerate(schedule.actions):
        for step, a in enumerate(acts):
            info = _TRANSFER.get(a.kind)
            if info is None:
                continue
            backward, offset, is_send, towards = info
            owner = schedule.rank_of(a.stage, a.unit)
            if rank != owner:
                raise _fail(schedule, f"{a} of stage {a.stage} is on rank {rank} but round "
                            f"robin puts unit {a.unit} on rank {owner}; move it", [(rank, step)])
            if not 0 <= a.stage + towards <= last:
                raise _fail(schedule, f"rank {rank} (stage {a.stage}) runs {a}, which talks to "
                            f"stage {a.stage + towards} outside 0..{last}; remove it",
                            [(rank, step)])
            (sends if is_send else recvs).append((backward, a.stage + offset, a.unit))
    sent, received = Counter(sends), Counter(recvs)
    if dict.__eq__(sent, received):  # plain dict comparison, in C
        return
    key = next(k for k in sent.keys() | received.keys() if sent[k] != received[k])
    backward, stage, unit = key
    what = "B" if backward else "F"
    src = schedule.rank_of(stage, unit)
    dst = schedule.rank_of(stage + (-1 if backward else 1), unit)
    where = [(rank, step) for rank, acts in enumerate(schedule.actions)
             for step, a in enumerate(acts) if _transfer_key(a) == key]
    raise _fail(schedule, f"rank {src} sends {what}{unit} to rank {dst} {sent[key]} "
                f"time(s) but rank {dst} receives it {received[key]} time(s); every "
                f"SEND_{what} needs exactly one RECV_{what} on its peer", where)


def _transfer_key(a: Action) -> tuple[int, int, int] | None:
    """(1 if gradient else 0, sending stage, unit) of a send/receive, else None.

    Ranks are implied: both ends sit on ``rank_of(stage, unit)`` of their stage.
    """
    info = _TRANSFER.get(a.kind)
    return None if info is None else (info[0], a.stage + info[1], a.unit)


def _dry_run(schedule: Schedule) -> None:
    """Execute in order: receives wait for their send, all-reduces for all replicas."""
    acts = schedule.actions
    pc = [0] * len(acts)
    sent: set[tuple[int, int, int]] = set()
    waiting: dict[tuple[int, int, int] | tuple[int, int], list[int]] = {}
    arrived: dict[tuple[int, int], set[int]] = {}
    ready = deque(range(len(acts)))
    while ready:
        rank = ready.popleft()
        mine = acts[rank]
        i = pc[rank]
        while i < len(mine):
            a = mine[i]
            info = _TRANSFER.get(a.kind)
            if info is not None:
                key = (info[0], a.stage + info[1], a.unit)
                if info[2]:
                    sent.add(key)
                    ready.extend(waiting.pop(key, ()))
                elif key not in sent:
                    waiting.setdefault(key, []).append(rank)
                    break
            elif a.kind is _K.ALLREDUCE:
                group = (a.stage, schedule.allreduce_round(a))
                members = arrived.setdefault(group, set())
                members.add(rank)
                if len(members) < schedule.replicas[a.stage]:
                    waiting.setdefault(group, []).append(rank)
                    break
                ready.extend(r for r in waiting.pop(group, ()) if r != rank)
            i += 1
        pc[rank] = i
    stuck = [r for r in range(len(acts)) if pc[r] < len(acts[r])]
    if stuck:
        parts = [f"rank {r} waits at {acts[r][pc[r]]}" for r in stuck[:6]]
        raise _fail(schedule, "deadlock: " + ", ".join(parts) + (
            ", ..." if len(stuck) > 6 else "") + "; no rank can move (each waits for a send "
            "or all-reduce that comes later on another rank); reorder the actions",
            [(r, pc[r]) for r in stuck])

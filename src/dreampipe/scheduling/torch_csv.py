"""PyTorch pipelining's schedule CSV (``torch.distributed.pipelining``), read.

PyTorch's ``_PipelineScheduleRuntime`` saves and loads a schedule as one CSV row per
rank, each cell an action ``<stage><kind><microbatch>`` (``0F1``, ``1RECV_B0``,
``0REDUCE_GRAD``). A file is one training step of unreplicated stages, stage ``s`` on
rank ``s mod p`` or in PyTorch's V (``s`` and ``2p - 1 - s`` on one rank, as zbv and
dualpipev place them): :func:`read_torch_csv` makes it a validated :class:`Schedule` of
one update (:mod:`.torch_csv_write` writes one back). ``I`` is dreampipe's
``B`` of a zero-bubble kind (``W`` after it), ``B`` its whole backward elsewhere; sends
keep their place, a receive moves to just before the action that uses it (where PyTorch
waits for it); ``REDUCE_GRAD`` is checked, then dropped for dreampipe's update pass
(each rank's ``STEP`` after its last action); FSDP's
``UNSHARD``/``RESHARD`` are dropped; ``OVERLAP_F_B`` is dualpipev's overlapped pair, its
parts in order elsewhere. A file without sends and receives gets dreampipe's
communication pass, as PyTorch's lowering adds them. No counterpart in dreampipe: mixed
whole and split backwards. The mapping: docs/design.md §7.11.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from dreampipe.errors import ConfigError, ScheduleError
from dreampipe.planning.placement import Placement, stage_rank
from dreampipe.scheduling.actions import (
    Action,
    ActionKind,
    Schedule,
    ScheduleKind,
)
from dreampipe.scheduling.build import lower_communication, lower_updates
from dreampipe.scheduling.formats import register_format

__all__ = ["check_file_fits", "parse_torch_csv", "read_torch_csv"]

_K = ActionKind
_CELL = re.compile(r"(\d+)(F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)"
                   r"(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_PER_STAGE = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
_COMPUTE = ("F", "I", "B", "W")
_EXAMPLES = "write e.g. 0F1, 1B0, 0I0, 0W0, 0SEND_F1, 1RECV_B0, 0UNSHARD or 0REDUCE_GRAD"
# PyTorch's name -> dreampipe's kind; "I" and "B" are both dreampipe's B
_KINDS = {"F": _K.FORWARD, "I": _K.BACKWARD, "B": _K.BACKWARD, "W": _K.WEIGHT,
          "SEND_F": _K.SEND_F, "RECV_F": _K.RECV_F, "SEND_B": _K.SEND_B, "RECV_B": _K.RECV_B}
# a receive -> the action on its stage and microbatch that uses it
_USER = {_K.RECV_F: _K.FORWARD, _K.RECV_B: _K.BACKWARD}



@dataclass(frozen=True)
class _Cell:
    """One action of the file, where it was written."""

    name: str
    stage: int
    microbatch: int
    line: int
    column: int
    text: str
    #: A part of an ``OVERLAP_F_B`` cell.
    paired: bool = False

    def error(self, source: str, sentence: str) -> ScheduleError:
        return ScheduleError(f"{source}:{self.line}: cell {self.column} {self.text!r}: "
                             f"{sentence}")


def read_torch_csv(path: str | os.PathLike[str], kind: ScheduleKind | None = None
                   ) -> Schedule:
    """The validated schedule of one update in a PyTorch pipelining CSV file
    (``_dump_csv``'s, either format); ``kind`` as :func:`parse_torch_csv` takes it."""
    with open(path, newline="") as file:
        return parse_torch_csv(file.read(), os.fspath(path), kind)


def parse_torch_csv(text: str, source: str, kind: ScheduleKind | None = None) -> Schedule:
    """The validated schedule of a PyTorch CSV ``text`` (``source`` names it in errors).

    ``kind``: the synchronous schedule the file is (None: ``zb-h1`` if it splits its
    backwards into ``I`` and ``W``, else ``interleaved-1f1b`` with several stages per
    rank, else ``gpipe`` where every rank runs all its forwards before its first backward
    on more than one microbatch, else ``1f1b-flush``; in the V placement ``dualpipev``
    if it overlaps pairs, else ``zbv``). Its microbatches make one update.
    """
    rows = list(_rows(text, source))
    if not rows:
        raise ScheduleError(f"{source} holds no actions; write one line of actions per rank")
    cells = [c for row in rows for c in row]
    ranks, stages = len(rows), 1 + max(c.stage for c in cells)
    placements = _placements(rows, stages, source)
    if stages % ranks:
        raise ScheduleError(f"{source}: stages 0..{stages - 1} on {ranks} ranks (lines); "
                            "give every rank the same number of stages")
    split = _splits(cells, source)
    pairs = any(c.paired for c in cells)
    named = kind
    kind = _kind(kind, split, stages // ranks, placements, pairs, source)
    if named is None and kind is ScheduleKind.FLUSH and _forwards_first(rows):
        kind = ScheduleKind.GPIPE
    _check_reduce_grads(rows, split, source)
    lists = [_actions(row, source, kind is ScheduleKind.DUALPIPEV) for row in rows]
    microbatches = 1 + max((c.microbatch for c in cells if c.name in _COMPUTE), default=-1)
    if not microbatches:
        raise ScheduleError(f"{source} computes nothing; give each stage's F, and B (or I "
                            "and W), of every microbatch")
    schedule = Schedule(kind, (1,) * stages, tuple(lists), microbatches, microbatches,
                        stages // ranks)
    if not any(a.transfer_key is not None for acts in lists for a in acts):
        schedule = lower_communication(schedule)
    else:
        schedule = schedule.with_actions([_handed_over(schedule, rank, acts)
                                          for rank, acts in enumerate(schedule.actions)])
    return _validated(lower_updates(schedule), source)


def check_file_fits(schedule: Schedule, replicas: Sequence[int], virtual_stages: int,
                    microbatches: int | None, source: str,
                    placement: Placement = Placement.LOOP) -> None:
    """A file's ``schedule`` runs on a plan of ``replicas`` and ``virtual_stages`` in
    ``placement`` with ``microbatches`` per update (None: any), or a ScheduleError (the
    stages) or a ConfigError (the counts) says what differs."""
    n, v = schedule.num_stages, schedule.virtual_stages
    if len(replicas) != n or any(r != 1 for r in replicas):
        raise ScheduleError(f"{source} runs {n} unreplicated stages but the plan has replicas "
                            f"{'-'.join(map(str, replicas))}; use a plan of {n} stages, one "
                            "replica each")
    if virtual_stages != v:
        raise ConfigError(f"{source} puts {v} stages on each of its {schedule.num_ranks} "
                          f"ranks, the plan {virtual_stages}; plan with virtual_stages={v}",
                          "virtual_stages")
    if v > 1 and schedule.num_ranks > 1 and schedule.placement is not placement:
        raise ConfigError(f"{source} places its {n} stages in the {schedule.placement.value} "
                          f"placement, the plan in the {placement.value}; make the plan with "
                          f"dreampipe plan --schedule {schedule.kind.value}", "plan")
    m = schedule.num_microbatches
    if microbatches is not None and microbatches != m:
        raise ConfigError(f"{source} runs {m} microbatches a minibatch, not microbatches="
                          f"{microbatches}; give microbatches={m}", "microbatches")


# ---- reading ---------------------------------------------------------------
def _rows(text: str, source: str) -> Iterator[list[_Cell]]:
    reader = csv.reader(io.StringIO(text))
    for row in reader:
        line = reader.line_num
        if not any(cell.strip() for cell in row):
            raise ScheduleError(f"{source}:{line}: no actions; each line is one rank's "
                                "actions, in order: remove the empty line")
        cells: list[_Cell] = []
        for column, text_ in enumerate(row, 1):
            cells += _parse_cell(text_.strip(), line, column, source)
        yield cells


def _parse_cell(text: str, line: int, column: int, source: str) -> list[_Cell]:
    """The actions of one cell: none (an idle step), one, or an ``OVERLAP_F_B``'s parts."""
    if not text:
        return []
    overlap = _OVERLAP.fullmatch(text)
    if overlap:
        parts = [_parse_cell(p.strip(), line, column, source) for p in overlap[1].split(";")]
        found = [c for part in parts for c in part]
        if not found or any(c.name not in _COMPUTE for c in found):
            raise ScheduleError(f"{source}:{line}: cell {column} {text!r}: an OVERLAP_F_B "
                                "holds computations, e.g. (0F1;1B0)OVERLAP_F_B")
        return [dataclasses.replace(c, paired=True) for c in found]
    m = _CELL.fullmatch(text)
    if m is None:
        raise ScheduleError(f"{source}:{line}: cell {column} {text!r} is not a PyTorch "
                            f"action; {_EXAMPLES}")
    stage, name, number = int(m[1]), m[2], m[3]
    if (name in _PER_STAGE) == bool(number):
        fix = (f"write {stage}{name} with no number" if number
               else f"give its microbatch, e.g. {stage}{name}0")
        raise ScheduleError(f"{source}:{line}: cell {column} {text!r}: {fix}")
    return [_Cell(name, stage, int(number or 0), line, column, text)]


def _placements(rows: list[list[_Cell]], stages: int, source: str) -> tuple[Placement, ...]:
    """The placements the file's stages fit: every stage ``s`` on rank ``s mod p`` (the
    loop), 2 a rank in a V, or both (one rank); a stage in neither is an error naming its
    line and the fix."""
    ranks = len(rows)
    cells = [(rank, c) for rank, row in enumerate(rows) for c in row]
    fits = tuple(placement for placement, fit in (
        (Placement.LOOP, all(c.stage % ranks == rank for rank, c in cells)),
        (Placement.V, stages == 2 * ranks and all(
            stage_rank(c.stage, stages, 2, Placement.V) == rank for rank, c in cells)))
        if fit)
    if fits:
        return fits
    rank, c = next((rank, c) for rank, c in cells if c.stage % ranks != rank)
    v = (f", or place every stage in PyTorch's V (stage s and {2 * ranks - 1}-s on one rank)"
         if stages == 2 * ranks else "")
    raise c.error(source, f"stage {c.stage} on rank {rank} (line {rank + 1}); dreampipe runs "
                  f"stage s on rank s mod {ranks}: move it to line {c.stage % ranks + 1}{v}")


def _splits(cells: list[_Cell], source: str) -> bool:
    """Whether the file splits every backward into ``I`` and ``W`` (dreampipe runs a
    schedule's backwards all split or all whole)."""
    whole = next((c for c in cells if c.name == "B"), None)
    split = next((c for c in cells if c.name in ("I", "W")), None)
    if whole is not None and split is not None:
        raise whole.error(source, f"a whole backward in a file that splits others (cell "
                          f"{split.column} {split.text!r} of line {split.line}); dreampipe "
                          f"runs all backwards whole or all split: write {whole.stage}I"
                          f"{whole.microbatch} {whole.stage}W{whole.microbatch}")
    return split is not None


def _forwards_first(rows: list[list[_Cell]]) -> bool:
    """Whether the file is GPipe's order: more than one microbatch, and on every rank
    all forwards before the first backward (1F1B's last rank alternates them)."""
    if max((c.microbatch for row in rows for c in row if c.name in _COMPUTE), default=0) < 1:
        return False
    names = [[c.name for c in row if c.name in _COMPUTE] for row in rows]
    return all("B" not in row or "F" not in row[row.index("B"):] for row in names)


def _kind(kind: ScheduleKind | None, split: bool, virtual: int,
          placements: tuple[Placement, ...], pairs: bool, source: str) -> ScheduleKind:
    if kind is None:
        if Placement.LOOP not in placements:
            return ScheduleKind.DUALPIPEV if pairs else ScheduleKind.ZBV
        return (ScheduleKind.ZB_H1 if split else
                ScheduleKind.INTERLEAVED if virtual > 1 else ScheduleKind.FLUSH)
    if not kind.synchronous:
        raise ScheduleError(f"{source}: kind {kind.value} updates within a step; a PyTorch "
                            "schedule is one synchronous step: give a synchronous kind, e.g. "
                            "1f1b-flush")
    if split != kind.splits_backward:
        has, fits = ("splits its backwards (I, W)", "zb-h1 or zb-h2 (zbv or dualpipev in a V)") \
            if split else ("runs whole backwards (B)", "1f1b-flush, gpipe or interleaved-1f1b")
        raise ScheduleError(f"{source} {has} but kind {kind.value} does not; give {fits}")
    if virtual > 1 and kind.placement not in placements:
        placement = placements[0]
        fits = "zbv or dualpipev" if placement is Placement.V else "interleaved-1f1b or zb-h1"
        raise ScheduleError(f"{source} places its stages in the {placement.value} placement "
                            f"but kind {kind.value} in the {kind.placement.value}; give {fits}")
    return kind


def _check_reduce_grads(rows: list[list[_Cell]], split: bool, source: str) -> None:
    """A ``REDUCE_GRAD`` follows its stage's last backward, once: it is dropped, so one out
    of place means the file is not what PyTorch's runtime would run the same way."""
    last = "W" if split else "B"
    for row in rows:
        seen: dict[int, _Cell] = {}
        for c in row:
            early = seen.get(c.stage)
            if early is not None and c.name in (last, "REDUCE_GRAD"):
                raise early.error(source, f"comes before {c.text!r} (line {c.line}, cell "
                                  f"{c.column}); a stage reduces its gradient once, after its "
                                  "last backward: move it there")
            if c.name == "REDUCE_GRAD":
                seen[c.stage] = c


def _actions(row: list[_Cell], source: str, pairs: bool) -> tuple[Action, ...]:
    """One rank's actions: each receive moved to just before the action that uses it; an
    ``OVERLAP_F_B`` one action with ``pairs``, else its parts in order."""
    out: list[Action] = []
    waiting: dict[Action, _Cell] = {}
    for a, c in _computations(row, pairs):
        if a.kind in _USER:
            if a in waiting:
                raise c.error(source, "a second receive of the same data; remove one")
            waiting[a] = c
            continue
        for part in a.parts:
            for recv, user in _USER.items():
                key = Action(recv, part.stage, part.microbatch)
                if user is part.kind and key in waiting:
                    del waiting[key]
                    out.append(key)
        out.append(a)
    for c in waiting.values():
        use = f"{c.stage}{'F' if c.name == 'RECV_F' else 'B or I'}{c.microbatch}"
        raise c.error(source, f"no {use} follows it on this rank; a receive goes before the "
                      "action that uses its data: move it there, or remove it")
    return tuple(out)


def _computations(row: list[_Cell], pairs: bool) -> Iterator[tuple[Action, _Cell]]:
    """The row's actions with their cells, an overlapped forward and backward as one
    ``OVERLAP_F_B`` with ``pairs``; UNSHARD, RESHARD and REDUCE_GRAD left out."""
    held: list[tuple[Action, _Cell]] = []
    for c in row:
        kind = _KINDS.get(c.name)
        if kind is None:
            continue
        a = Action(kind, c.stage, c.microbatch)
        if pairs and c.paired and kind in (_K.FORWARD, _K.BACKWARD):
            if held and (held[0][1].line, held[0][1].column) != (c.line, c.column):
                yield from held
                held = []
            held.append((a, c))
            if len(held) == 2:
                (f, first), (b, _) = sorted(held, key=lambda x: x[0].kind is not _K.FORWARD)
                if (f.kind, b.kind) == (_K.FORWARD, _K.BACKWARD):
                    yield Action.overlap(f, b), first
                else:
                    yield from held
                held = []
            continue
        yield from held
        held = []
        yield a, c
    yield from held


def _handed_over(schedule: Schedule, rank: int, acts: tuple[Action, ...]) -> tuple[Action, ...]:
    """``acts`` with the transfers between two stages of ``rank`` that PyTorch leaves out
    (it hands the tensor over): the send right after the computation that makes it, the
    receive right before the one that uses it (dreampipe's mailbox, docs/design.md §8.4)."""
    have = set(acts)
    before: dict[Action, list[Action]] = {}
    after: dict[Action, list[Action]] = {}
    for a in acts:
        for part in a.parts:
            if part.kind not in (_K.FORWARD, _K.BACKWARD):
                continue
            up = part.kind is _K.FORWARD
            peer = part.stage + (1 if up else -1)
            if not 0 <= peer < schedule.num_stages or schedule.rank_of(peer, 0) != rank:
                continue
            send = Action(_K.SEND_F if up else _K.SEND_B, part.stage, part.microbatch)
            recv = Action(_K.RECV_F if up else _K.RECV_B, peer, part.microbatch)
            if send not in have:
                after.setdefault(part, []).append(send)
            if recv not in have:
                before.setdefault(Action(part.kind, peer, part.microbatch), []).append(recv)
    out: list[Action] = []
    for a in acts:
        out += [r for part in a.parts for r in before.get(part, ())]
        out.append(a)
        out += [x for part in a.parts for x in after.get(part, ())]
    return tuple(out)


def _validated(schedule: Schedule, source: str) -> Schedule:
    from dreampipe.scheduling.validator import validate_schedule

    try:
        validate_schedule(schedule)
    except ScheduleError as exc:
        raise ScheduleError(f"{source}: {exc}") from None
    return schedule


register_format("torch-csv", read=read_torch_csv)

"""A dreampipe schedule written as PyTorch pipelining's schedule CSV.

:func:`torch_csv` makes the text that PyTorch's ``_PipelineScheduleRuntime._load_csv``
reads, either format: ``compute_comms`` with sends, receives and ``REDUCE_GRAD`` (where
dreampipe's ``STEP`` is), or ``compute_only`` for PyTorch's own lowering. A transfer
between two stages of one rank is left out: PyTorch hands the tensor over. What the
format cannot express (replicas, ``ALLREDUCE``, ZeRO-3's gathers, asynchronous kinds,
several updates) is refused with a ScheduleError. Reading: :mod:`.torch_csv`; the
mapping: docs/design.md §7.11.
"""

from __future__ import annotations

import csv
import io
import os

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import Action, ActionKind, Schedule
from dreampipe.scheduling.formats import register_format

__all__ = ["torch_csv", "write_torch_csv"]

_K = ActionKind
_WRITTEN = {_K.FORWARD: "F", _K.WEIGHT: "W", _K.SEND_F: "SEND_F", _K.RECV_F: "RECV_F",
            _K.SEND_B: "SEND_B", _K.RECV_B: "RECV_B"}


def write_torch_csv(schedule: Schedule, path: str | os.PathLike[str], comms: bool = True
                    ) -> None:
    """Write ``schedule``, one update, as :func:`torch_csv` makes it."""
    text = torch_csv(schedule, comms)
    with open(path, "w", newline="") as file:
        file.write(text)


def torch_csv(schedule: Schedule, comms: bool = True) -> str:
    """``schedule`` as PyTorch's CSV: with ``comms``, sends, receives and ``REDUCE_GRAD``
    for ``_load_csv(format="compute_comms")``; without, its computations alone for
    ``format="compute_only"`` (PyTorch's lowering adds the rest). One update of
    unreplicated stages of a synchronous kind; a ScheduleError says what else cannot be
    written."""
    _check_writable(schedule)
    split = schedule.kind.splits_backward
    out = io.StringIO()
    writer = csv.writer(out)  # PyTorch's own _dump_csv writes with csv's defaults
    for rank, acts in enumerate(schedule.actions):
        cells = []
        for a in acts:
            if a.kind is _K.STEP:
                cells += [f"{a.stage}REDUCE_GRAD"] if comms else []
            elif a.kind is _K.BACKWARD:
                cells.append(f"{a.stage}{'I' if split else 'B'}{a.microbatch}")
            elif a.kind is _K.OVERLAP:
                f, b = a.parts
                cells.append(f"({f.stage}F{f.microbatch};{b.stage}{'I' if split else 'B'}"
                             f"{b.microbatch})OVERLAP_F_B")
            elif a.kind in _WRITTEN and not (a.transfer_key is not None and (
                    not comms or _local(schedule, rank, a))):
                cells.append(f"{a.stage}{_WRITTEN[a.kind]}{a.microbatch}")
        writer.writerow(cells)
    return out.getvalue()


def _check_writable(schedule: Schedule) -> None:
    kind = schedule.kind
    if not kind.synchronous:
        raise ScheduleError(f"a {kind.value} schedule updates within a step; PyTorch's "
                            "runtime runs one synchronous step: write a synchronous kind")
    replicated = [s for s, r in enumerate(schedule.replicas) if r > 1]
    if replicated:
        s = replicated[0]
        raise ScheduleError(f"stage {s} has {schedule.replicas[s]} replicas; PyTorch's "
                            "schedule runs one rank per stage (data parallelism is FSDP's or "
                            "DDP's, outside it): write the schedule of an unreplicated plan")
    other = next((a for acts in schedule.actions for a in acts
                  if a.kind in (_K.ALLREDUCE, _K.UNSHARD, _K.RESHARD)), None)
    if other is not None:
        raise ScheduleError(f"{other} of stage {other.stage} joins its replicas, which "
                            "PyTorch's schedule has not: write an unreplicated schedule")
    if schedule.num_microbatches != schedule.microbatches_per_update:
        raise ScheduleError(
            f"{schedule.num_microbatches} microbatches, {schedule.microbatches_per_update} per "
            "update; a PyTorch schedule is one step: write the schedule of one update "
            f"({schedule.microbatches_per_update} microbatches)")


def _local(schedule: Schedule, rank: int, a: Action) -> bool:
    """A transfer between two stages of one rank, which PyTorch hands over without one."""
    peer = a.peer_stage
    return peer is not None and schedule.rank_of(peer, a.microbatch) == rank


register_format("torch-csv", write=write_torch_csv)

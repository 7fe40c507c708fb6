"""The epochs an asynchronous schedule needs to reach a target, against data parallelism's.

PipeDream's measure is time to target: epochs to the target over throughput. A
synchronous schedule trains as one process does, so it needs data parallelism's
epochs; pipedream and 2bw train on stale weights and may need more, or never get
there. :data:`ROWS` are dreampipe's convergence study (docs/convergence.md), written
by ``python benchmarks/convergence.py --report``. For a model the study has not seen,
:func:`epochs_factor` takes the worst of its workloads at the plan's number of stages
(or the nearest deeper row: more stages, more delay); a row where some seed never
reached the target, or a depth deeper than the study's, predicts never. Why the worst
and not a mean: docs/design.md §12, "Time to target".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dreampipe.scheduling.actions import ScheduleKind

__all__ = ["ROWS", "EpochsFactor", "StudyRow", "epochs_factor"]


@dataclass(frozen=True)
class StudyRow:
    """One workload, depth and schedule of the study: the median epochs to its target
    over the seeds (inf when some seed never reached it) and data parallelism's."""

    workload: str
    stages: int
    schedule: str
    epochs: float
    dp_epochs: float
    seeds: int

    @property
    def factor(self) -> float:
        """The schedule's epochs to target over data parallelism's (inf: never)."""
        return self.epochs / self.dp_epochs if self.dp_epochs > 0 else math.inf


@dataclass(frozen=True)
class EpochsFactor:
    """How many times data parallelism's epochs a schedule is predicted to need, and
    the study's row that says so (``why``)."""

    factor: float
    why: str


# begin: written by `python benchmarks/convergence.py --report`
ROWS: tuple[StudyRow, ...] = (
    StudyRow("digits", 2, "pipedream", 3.0, 2.0, 3),
    StudyRow("digits", 2, "2bw", 4.0, 2.0, 3),
    StudyRow("digits", 4, "pipedream", 4.0, 4.0, 3),
    StudyRow("digits", 4, "2bw", 4.0, 4.0, 3),
    StudyRow("chars", 2, "pipedream", 5.0, 4.0, 3),
    StudyRow("chars", 2, "2bw", 6.0, 4.0, 3),
    StudyRow("chars", 4, "pipedream", math.inf, 4.0, 3),
    StudyRow("chars", 4, "2bw", 6.0, 4.0, 3),
)
# end


def epochs_factor(kind: ScheduleKind, stages: int,
                  rows: Sequence[StudyRow] = ROWS) -> EpochsFactor:
    """The epochs ``kind`` on ``stages`` stages is predicted to need, as a multiple of
    data parallelism's (module doc): 1 for a synchronous schedule."""
    if kind.synchronous:
        return EpochsFactor(1.0, "synchronous")
    mine = [r for r in rows if r.schedule == kind.value]
    deeper = sorted({r.stages for r in mine if r.stages >= stages})
    if not deeper:
        most = max((r.stages for r in mine), default=0)
        return EpochsFactor(math.inf, f"the study's deepest {kind.value} run had {most} "
                            f"stages, not {stages}")
    depth = deeper[0]
    worst = max((r for r in mine if r.stages == depth), key=lambda r: r.factor)
    return EpochsFactor(worst.factor, f"the study's {worst.workload} at {depth} stages, "
                        "its worst workload")

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

__all__ = ["ROWS", "WARN_FACTOR", "EpochsFactor", "StudyRow", "epochs_factor", "study_advice"]

#: The most epochs, as a multiple of data parallelism's, an asynchronous schedule may need
#: in the study before :func:`study_advice` warns: the bound dreampipe holds them to.
WARN_FACTOR = 1.25


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
    #: The workload's optimizer family: ``"sgd"`` or ``"adam"`` (AdamW).
    optimizer: str

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
    StudyRow("digits", 2, "pipedream", 3.0, 2.0, 3, "sgd"),
    StudyRow("digits", 2, "2bw", 4.0, 2.0, 3, "sgd"),
    StudyRow("digits", 4, "pipedream", 4.0, 4.0, 3, "sgd"),
    StudyRow("digits", 4, "2bw", 4.0, 4.0, 3, "sgd"),
    StudyRow("digits", 8, "pipedream", 6.0, 3.0, 3, "sgd"),
    StudyRow("digits", 8, "2bw", 4.0, 3.0, 3, "sgd"),
    StudyRow("chars", 2, "pipedream", 5.0, 4.0, 3, "adam"),
    StudyRow("chars", 2, "2bw", 6.0, 4.0, 3, "adam"),
    StudyRow("chars", 4, "pipedream", math.inf, 4.0, 3, "adam"),
    StudyRow("chars", 4, "2bw", 6.0, 4.0, 3, "adam"),
    StudyRow("chars8", 8, "pipedream", math.inf, 4.0, 3, "adam"),
    StudyRow("chars8", 8, "2bw", 7.0, 4.0, 3, "adam"),
    StudyRow("mlp", 4, "pipedream", 4.0, 4.0, 3, "sgd"),
    StudyRow("mlp", 4, "2bw", 3.0, 4.0, 3, "sgd"),
    StudyRow("gpt2", 4, "pipedream", math.inf, 3.0, 3, "adam"),
    StudyRow("gpt2", 4, "2bw", math.inf, 3.0, 3, "adam"),
)
# end


def epochs_factor(kind: ScheduleKind, stages: int, rows: Sequence[StudyRow] = ROWS,
                  optimizer: str | None = None) -> EpochsFactor:
    """The epochs ``kind`` on ``stages`` stages is predicted to need, as a multiple of
    data parallelism's (module doc): 1 for a synchronous schedule and for pipedream on one
    stage (which has no delay; 2bw's one update of delay holds at any depth). ``optimizer`` (a
    family, ``"sgd"`` or ``"adam"``) reads only the study's workloads trained so, where
    it has any."""
    if kind.synchronous:
        return EpochsFactor(1.0, "synchronous")
    if kind is ScheduleKind.PIPEDREAM and stages <= 1:
        # one stage updates before its next forward: data parallelism, nothing stale
        return EpochsFactor(1.0, "one stage: no delay")
    mine = [r for r in rows if r.schedule == kind.value]
    if any(r.optimizer == optimizer for r in mine):
        mine = [r for r in mine if r.optimizer == optimizer]
    deeper = sorted({r.stages for r in mine if r.stages >= stages})
    if not deeper:
        most = max((r.stages for r in mine), default=0)
        return EpochsFactor(math.inf, f"the study's deepest {kind.value} run had {most} "
                            f"stages, not {stages}")
    depth = deeper[0]
    worst = max((r for r in mine if r.stages == depth), key=lambda r: r.factor)
    return EpochsFactor(worst.factor, f"the study's {worst.workload} at {depth} stages, "
                        "its worst workload")


def study_advice(kind: ScheduleKind, stages: int, optimizer: str | None,
                 rows: Sequence[StudyRow] = ROWS, *, weighed: bool = False) -> str | None:
    """What to change when the study says ``kind`` on ``stages`` stages, with an optimizer
    of family ``optimizer``, needs more than :data:`WARN_FACTOR` times data parallelism's
    epochs to the target, or never reaches it; None if it does not say so. ``weighed``:
    ``schedule="auto"`` chose ``kind`` with those epochs counted, so nothing is to change
    but what the user may prefer."""
    said = epochs_factor(kind, stages, rows, optimizer)
    if said.factor <= WARN_FACTOR:
        return None
    needs = ("never reached data parallelism's target" if math.isinf(said.factor) else
             f"needed {said.factor:.2f}x data parallelism's epochs to its target")
    found = (f"{kind.value} on {stages} stages: in dreampipe's convergence study it {needs} "
             f"({said.why}{'' if optimizer is None else f', {optimizer}'})")
    if weighed:
        return (f"{found}; schedule='auto' with semantics='any' chose it with those epochs "
                "counted, as the soonest to the target by its throughput (semantics='sync' "
                "keeps data parallelism's epochs)")
    return (f"{found}; train with a synchronous schedule (schedule='1f1b-flush', which "
            "takes data parallelism's epochs), or schedule='auto' with semantics='any' to "
            "weigh both, or fewer stages")

"""PipeDream-2BW's weight versions: minibatch ``k`` runs on the weights of update ``k - 1``.

PipeDream-2BW (Narayanan et al., ICML 2021) keeps two weight versions per
stage: every microbatch of a segment's minibatch ``k`` runs on the stage's
weights after ``k - 1`` of the segment's updates (none for ``k = 0``), and
update ``k`` applies their summed gradient to the newest weights, a delay of
one update on every stage whatever the depth. The stage's weight stashing
(:class:`~dreampipe.runtime.stage_module.StageModule`) keeps the version a step
replaces while the next minibatch still needs it. :func:`check_two_versions`
refuses a schedule whose minibatch ``k + 1`` starts on a stage before its
update ``k - 1`` (docs/design.md §7.8).
"""

from __future__ import annotations

import math

from dreampipe.errors import ScheduleError
from dreampipe.scheduling.actions import ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.weight_versions import runs_on

__all__ = ["TwoVersions", "check_two_versions", "fewest_microbatches"]

#: The largest microbatch count :func:`fewest_microbatches` tries.
_MOST_MICROBATCHES = 256


class TwoVersions:
    """The weight version each forward of a 2bw segment runs on (module doc)."""

    def __init__(self, microbatches_per_update: int) -> None:
        self.microbatches_per_update = microbatches_per_update
        self._base: int | None = None

    def restart(self) -> None:
        """A new segment: its first forward takes the stage's version then as its base."""
        self._base = None

    def version(self, microbatch: int, current: int) -> int:
        """The version microbatch ``microbatch`` of the segment runs on; ``current`` is the stage's
        version now (its updates so far), the base at the segment's first forward."""
        if self._base is None:
            self._base = current
        return self._base + runs_on(ScheduleKind.TWO_BW, microbatch,
                                    self.microbatches_per_update, current)


def _runs_on_two_versions(schedule: Schedule) -> bool:
    """Whether every rank's forward of minibatch ``k`` comes after its update ``k - 2``."""
    m = schedule.microbatches_per_update
    for acts in schedule.actions:
        steps = 0
        for a in acts:
            if a.kind is ActionKind.STEP:
                steps += 1
            elif a.kind is ActionKind.FORWARD and steps < a.microbatch // m - 1:
                return False
    return True


def fewest_microbatches(replicas: tuple[int, ...]) -> int:
    """The fewest microbatches per minibatch whose 2bw schedule runs on two versions."""
    step = math.lcm(*replicas)
    for m in range(step, _MOST_MICROBATCHES + 1, step):
        if _runs_on_two_versions(build_schedule(replicas, ScheduleKind.TWO_BW, 3 * m, m)):
            return m
    raise ScheduleError(f"no 2bw schedule of up to {_MOST_MICROBATCHES} microbatches per "
                        f"minibatch runs on two weight versions over replicas {list(replicas)}; "
                        "plan fewer stages")


def check_two_versions(schedule: Schedule) -> None:
    """A 2bw ``schedule`` starts no minibatch on a version its stage has not made yet."""
    if schedule.kind is not ScheduleKind.TWO_BW or _runs_on_two_versions(schedule):
        return
    fewest = fewest_microbatches(schedule.replicas)
    raise ScheduleError(
        f"2bw with {schedule.microbatches_per_update} microbatches per minibatch over replicas "
        f"{list(schedule.replicas)}: a stage would start minibatch k+1 before its update "
        f"k-1, which two weight versions cannot hold; use at least {fewest} microbatches "
        "per minibatch"
    )

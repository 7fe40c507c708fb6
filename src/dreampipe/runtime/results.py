"""What one rank measured, and the pieces rank 0 builds a run's result from once gathered."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from dreampipe.scheduling.events import Event

if TYPE_CHECKING:
    from dreampipe.runtime.memory_meter import MemoryUse

__all__ = ["RankReport", "sorted_events", "stage_states"]


@dataclass
class RankReport:
    """One rank's loop seconds, events, final state and memory; gathered on rank 0."""

    rank: int
    stage: int
    replica: int
    loop_s: float
    events: list[Event] = field(default_factory=list)
    state: dict[str, Tensor] | None = None
    memory: MemoryUse | None = None


def stage_states(reports: list[RankReport], num_stages: int) -> list[dict[str, Tensor]]:
    """Each stage's final ``state_dict``, from the report of its replica 0."""
    states: list[dict[str, Tensor]] = [{} for _ in range(num_stages)]
    for rep in reports:
        if rep.replica == 0 and rep.state is not None:
            states[rep.stage] = rep.state
    return states


def sorted_events(reports: list[RankReport]) -> tuple[Event, ...]:
    """Every rank's events on the one time line, in start order."""
    return tuple(sorted((e for rep in reports for e in rep.events),
                        key=lambda e: (e.start_s, e.rank)))

"""Events: what a rank did (or is predicted to do) and when.

The simulator produces them and the runtime records them in the same form,
so measured and predicted timelines are drawn by the same code. Times are
seconds from the start of the run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dreampipe.scheduling.actions import Action, ActionKind

__all__ = ["Event", "load_events", "save_events"]


@dataclass(frozen=True, slots=True)
class Event:
    rank: int
    stage: int
    kind: ActionKind
    microbatch: int
    start_s: float
    end_s: float

    @classmethod
    def of(cls, rank: int, action: Action, start_s: float, end_s: float) -> Event:
        return cls(rank, action.stage, action.kind, action.microbatch, start_s, end_s)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def label(self) -> str:
        return f"{self.kind.value}{self.microbatch}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "stage": self.stage, "kind": self.kind.value,
            "microbatch": self.microbatch, "start_s": self.start_s, "end_s": self.end_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Event:
        return cls(
            int(d["rank"]), int(d["stage"]), ActionKind(d["kind"]),
            int(d["microbatch"] if "microbatch" in d else d["unit"]),  # "unit": older files
            float(d["start_s"]), float(d["end_s"]),
        )


def save_events(events: Sequence[Event], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"events": [e.to_dict() for e in events]}) + "\n")


def load_events(path: str | Path) -> list[Event]:
    data = json.loads(Path(path).read_text())
    return [Event.from_dict(d) for d in data["events"]]

"""Chrome trace export: any event list as JSON that ui.perfetto.dev and
chrome://tracing open.

Each rank is a process (``pid`` = rank, named ``rank 3 (stage 1)``); compute
(F, B, STEP) is its first thread, an overlapped pair (``OVERLAP_F_B``) a slice around
its forward's and its backward's, and communication (sends, receives,
all-reduces) goes on further threads, one lane per overlapping transfer, so
no two slices on a thread overlap but those nested. Times are microseconds from the earliest
event (measured traces start at an arbitrary offset).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dreampipe.scheduling.actions import ActionKind
from dreampipe.scheduling.events import Event

__all__ = ["chrome_trace", "write_chrome_trace"]

_COMPUTE = {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT, ActionKind.STEP,
            ActionKind.OVERLAP}


def chrome_trace(events: Sequence[Event]) -> dict[str, Any]:
    """The trace as a ``{"traceEvents": [...]}`` dict (``ph: "X"`` slices)."""
    origin = min((e.start_s for e in events), default=0.0)
    out: list[dict[str, Any]] = []
    stages: dict[int, set[int]] = {}
    lanes: dict[tuple[int, int], list[float]] = {}
    names: set[tuple[int, int]] = set()
    for e in sorted(events, key=lambda e: (e.rank, e.start_s, e.start_s - e.end_s)):
        stages.setdefault(e.rank, set()).add(e.stage)
        compute = e.kind in _COMPUTE
        tid = 0 if compute else 1 + _lane(lanes.setdefault((e.rank, 1), []), e)
        names.add((e.rank, tid))
        out.append({
            "name": e.label,
            "cat": "compute" if compute else "comm",
            "ph": "X",
            "ts": round((e.start_s - origin) * 1e6, 3),
            "dur": round(max(e.end_s - e.start_s, 0.0) * 1e6, 3),
            "pid": e.rank,
            "tid": tid,
            "args": {"stage": e.stage, "microbatch": e.microbatch, "kind": e.kind.value},
        })
    meta: list[dict[str, Any]] = []
    for rank, held in sorted(stages.items()):
        stage_list = ", ".join(map(str, sorted(held)))
        meta.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                     "args": {"name": f"rank {rank} (stage{'s' if len(held) > 1 else ''} "
                                      f"{stage_list})"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                     "args": {"sort_index": rank}})
    for rank, tid in sorted(names):
        meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                     "args": {"name": "compute" if tid == 0 else f"comm {tid}"}})
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Sequence[Event], path: str | Path) -> None:
    """Write :func:`chrome_trace` of ``events`` to ``path``."""
    Path(path).write_text(json.dumps(chrome_trace(events)) + "\n")


def _lane(ends: list[float], e: Event) -> int:
    """The first lane free at ``e.start_s`` (events arrive sorted by start)."""
    for i, end in enumerate(ends):
        if end <= e.start_s:
            ends[i] = e.end_s
            return i
    ends.append(e.end_s)
    return len(ends) - 1

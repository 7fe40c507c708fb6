"""When transfers run on links that several ranks share: each link's calendar of busy spans.

A transfer holds each link of its path for its whole duration, one transfer at
a time per link. Its bytes flow through as they leave the link before (cut-through),
so it starts on a link no earlier than it started on the one before, and ends
``duration`` after it started on the last. The simulator steps one rank at a time,
so a transfer posted later may be placed before one posted earlier: each link
gives a transfer its earliest free span from then on, not the span after the last
one placed (docs/design.md §9).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence

__all__ = ["LinkCalendar"]


class LinkCalendar:
    """Busy spans per link; :meth:`transfer` places a transfer on its path of links."""

    def __init__(self) -> None:
        self._starts: dict[Hashable, list[float]] = {}
        self._ends: dict[Hashable, list[float]] = {}

    def transfer(self, path: Sequence[Hashable], ready: float,
                 duration: float) -> tuple[float, float]:
        """Book ``duration`` seconds on each link of ``path`` in turn, from ``ready`` on;
        ``(start on the first link, end on the last)``."""
        first = at = ready
        for i, link in enumerate(path):
            at = self._book(link, at, duration)
            if i == 0:
                first = at
        return first, at + duration

    def _book(self, link: Hashable, ready: float, duration: float) -> float:
        """Reserve ``duration`` on ``link`` at its earliest free span from ``ready``."""
        if duration <= 0:
            return ready
        starts = self._starts.setdefault(link, [])
        ends = self._ends.setdefault(link, [])
        start = ready
        i = max(0, bisect.bisect_right(starts, start) - 1)
        while i < len(starts) and starts[i] < start + duration:
            if ends[i] > start:  # overlaps: try right after it
                start = ends[i]
            i += 1
        at = bisect.bisect_right(starts, start)
        starts.insert(at, start)
        ends.insert(at, start + duration)
        return start

"""What one rank's actions hold at once: its microbatches in flight and weight versions.

A version is the weights after some number of a stage's updates, counted from the
schedule's start. PipeDream-2BW runs every microbatch of minibatch ``k`` on the weights
of update ``k - 1`` (none for ``k = 0``), so once an update has run a rank holds the
version the next minibatch runs on beside the live weights the update changes: two
copies, not one (Narayanan et al., ICML 2021). Every other schedule runs a forward on
the live weights; PipeDream's stashing pins the version each microbatch in flight ran on.
A microbatch is in flight from its forward to the action that frees what it keeps: its
``W`` where the rank splits the backward (``B`` keeps the graph for it), else its
backward. The runtime (:mod:`dreampipe.runtime.two_bw`), the simulator's memory and the
memory prediction (:mod:`dreampipe.runtime.memory`) read the rules here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from dreampipe.scheduling.actions import Action, ActionKind, ScheduleKind

__all__ = ["peak_in_flight", "peak_versions", "release_kind", "runs_on"]


def runs_on(kind: ScheduleKind, microbatch: int, microbatches_per_update: int,
            live: int) -> int:
    """The version a forward of ``microbatch`` runs on: under 2bw its minibatch's
    predecessor's update, else ``live`` (the updates the rank has run)."""
    if kind is ScheduleKind.TWO_BW:
        return max(microbatch // microbatches_per_update - 1, 0)
    return live


def release_kind(actions: Sequence[Action]) -> ActionKind:
    """The action that frees a microbatch's kept tensors on a rank (module doc)."""
    return ActionKind.WEIGHT if any(a.kind is ActionKind.WEIGHT for a in actions) \
        else ActionKind.BACKWARD


def peak_in_flight(actions: Sequence[Action]) -> int:
    """The most microbatches whose forward ran and whose kept tensors are not freed yet,
    along one rank's ``actions``."""
    release = release_kind(actions)
    now = peak = 0
    for a in actions:
        if a.kind is ActionKind.FORWARD:
            now += 1
            peak = max(peak, now)
        elif a.kind is release:
            now -= 1
    return peak


def peak_versions(actions: Iterable[Action], kind: ScheduleKind,
                  microbatches_per_update: int) -> int:
    """The most weight versions one stage's ``actions`` (one rank's) hold at once: those
    its microbatches in flight run on (until their backward, or ``W`` where the backward
    is split) and the live one."""
    acts = tuple(actions)
    release = release_kind(acts)
    live, peak = 0, 1
    pinned: Counter[int] = Counter()
    of: dict[int, int] = {}
    for a in acts:
        if a.kind is ActionKind.FORWARD:
            of[a.microbatch] = runs_on(kind, a.microbatch, microbatches_per_update, live)
            pinned[of[a.microbatch]] += 1
        elif a.kind is release and a.microbatch in of:
            v = of.pop(a.microbatch)
            pinned[v] -= 1
            if not pinned[v]:
                del pinned[v]
        elif a.kind is ActionKind.STEP:
            live += 1
        peak = max(peak, len(pinned) + (live not in pinned))
    return peak

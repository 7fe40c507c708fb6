"""How replicas synchronise their gradients: four all-reduce algorithms in the alpha-beta model.

Each prices one all-reduce of ``n`` bytes among the replicas of a stage, laid
on a topology as ``groups``: ``groups[k]`` units of level k-1 are used inside
each unit of level k (``groups[0]`` workers per server, ``groups[1]``
servers, ...), ``p = prod(groups)`` replicas in all. The hierarchical ring
(the default) pays each level's latency and bandwidth separately; ``ring``,
``halving-doubling`` and ``ps`` (a parameter server) run flat over the
outermost level the replicas span. The formulas, their sources and why they
differ: docs/design.md §3.3.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from dreampipe.errors import PlanError
from dreampipe.planning.topology import Level, Topology

__all__ = [
    "DEFAULT_SYNC", "Sync", "SyncKind", "allreduce_seconds", "allreduce_terms", "replica_groups",
]

FloatArray = npt.NDArray[np.float64]


class SyncKind(StrEnum):
    """The all-reduce algorithm replicated stages use (``--sync``)."""

    RING = "ring"
    HIERARCHICAL = "hierarchical"
    HALVING_DOUBLING = "halving-doubling"
    PARAMETER_SERVER = "ps"


@dataclass(frozen=True)
class Sync:
    """An all-reduce algorithm; ``shards`` is the parameter server's shard count."""

    kind: SyncKind = SyncKind.HIERARCHICAL
    shards: int = 1

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise PlanError(
                f"a parameter server needs at least 1 shard, got {self.shards}; e.g. --ps-shards 4"
            )


#: The default: a hierarchical ring, what NCCL does across nodes; on one level, a ring.
DEFAULT_SYNC = Sync()


def _terms(
    groups: Sequence[int], levels: Sequence[Level], sync: Sync, p: int
) -> tuple[float, float]:
    """``(latency seconds, seconds per byte)`` of one all-reduce: time = first + second * n."""
    if p <= 1:
        return 0.0, 0.0
    h = max(k for k, g in enumerate(groups) if g > 1)
    alpha, beta = levels[h].latency, 1.0 / levels[h].bandwidth
    kind = sync.kind
    if kind is SyncKind.HIERARCHICAL:
        lat = sum(2 * (g - 1) * lv.latency for g, lv in zip(groups, levels, strict=True))
        per = sum(2 * (g - 1) / g / lv.bandwidth for g, lv in zip(groups, levels, strict=True))
        return lat, per
    if kind is SyncKind.RING:
        return 2 * (p - 1) * alpha, 2 * (p - 1) / p * beta
    if kind is SyncKind.HALVING_DOUBLING:
        q = 1 << (p.bit_length() - 1)
        steps = 2 * (q.bit_length() - 1)
        if q == p:
            return steps * alpha, 2 * (p - 1) / p * beta
        return (steps + 2) * alpha, (2 * (q - 1) / q + 2) * beta
    return 2 * alpha, 2 * max(1.0, p / sync.shards) * beta


def allreduce_terms(
    groups: Sequence[int], levels: Sequence[Level], sync: Sync, replicas: int | None = None,
) -> tuple[float, float]:
    """``(latency s, s per byte)``: one all-reduce of ``n`` bytes takes ``latency + n * per``.

    The same layout arguments as :func:`allreduce_seconds`; the split lets a
    caller price part of a stage's weights (a bucket) with the same terms.
    """
    if len(groups) != len(levels):
        raise PlanError(f"replica groups {list(groups)} need one entry per level ({len(levels)})")
    p = math.prod(groups) if replicas is None else replicas
    return _terms(groups, levels, sync, p)


def allreduce_seconds(
    weight_bytes: FloatArray | float, groups: Sequence[int], levels: Sequence[Level], sync: Sync,
    replicas: int | None = None,
) -> FloatArray:
    """One all-reduce of ``weight_bytes`` among replicas laid out as ``groups`` (module doc).

    ``groups`` has one entry per level of ``levels`` (innermost first);
    ``replicas`` is ``p`` when the layout is uneven (default ``prod(groups)``).
    A stage without weights has nothing to synchronise and costs 0.
    """
    lat, per = allreduce_terms(groups, levels, sync, replicas)
    w = np.asarray(weight_bytes, dtype=np.float64)
    return np.asarray(np.where(w > 0, lat + per * w, 0.0))


def replica_groups(ranks: Sequence[int], topology: Topology) -> tuple[int, ...]:
    """How ``ranks`` spread over the levels: ``groups[k]`` is the most units of level k-1
    that the ranks use inside one unit of level k (workers per server at k = 0).

    Exact for the planner's own layouts (the same count in every unit); for
    uneven ones it takes the largest, the group that finishes last.
    """
    groups, size = [], 1
    for level in topology.levels:
        outer = size * level.count
        used: dict[int, set[int]] = {}
        for r in ranks:
            used.setdefault(r // outer, set()).add(r // size)
        groups.append(max(len(units) for units in used.values()))
        size = outer
    return tuple(groups)

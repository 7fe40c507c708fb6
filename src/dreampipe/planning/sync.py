"""How replicas synchronise their gradients: four all-reduce algorithms in the alpha-beta model.

Each model prices one all-reduce of ``n`` bytes among the replicas of a
stage, laid on a topology as ``groups``: ``groups[k]`` units of level k-1
are used inside each unit of level k (``groups[0]`` workers per server,
``groups[1]`` servers, ...), ``p = prod(groups)`` replicas in all. ``h`` is
the outermost level with ``groups[h] > 1`` (its link, alpha_h and B_h, is the
slowest any flat algorithm crosses)::

    ring              2(p-1) a_h  +  2(p-1)/p n / B_h
    hierarchical      sum over k of  2(g_k-1) a_k  +  2(g_k-1)/g_k n / B_k
    halving-doubling  2 log2(p) a_h  +  2(p-1)/p n / B_h          (p a power of 2)
                      (2 log2(p') + 2) a_h + (2(p'-1)/p' + 2) n / B_h,  p' = 2^floor(log2 p)
    parameter server  2 a_h  +  2 max(1, p/k) n / B_h            (k shards)

The ring (Patarasuk and Yuan, 2009) is bandwidth-optimal but pays ``2(p-1)``
latencies. The hierarchical ring (reduce-scatter inside each unit, ring
across units, all-gather inside; as in Horovod and NCCL across nodes) pays
each level's latency only ``2(g_k-1)`` times and moves the cross-unit bytes
once over each unit's shared link. Recursive halving-doubling (Thakur,
Rabenseifner and Gropp, 2005) has the ring's bandwidth term with ``2 log2 p``
latencies, plus an extra exchange when ``p`` is not a power of two. A
parameter server with ``k`` shards pushes and pulls every gradient: its
busiest link carries ``max(n, p n / k)`` each way.
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

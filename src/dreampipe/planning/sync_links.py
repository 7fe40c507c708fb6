"""The links a synchronous plan's ``d`` copies of the pipeline use, each on its own units.

A stage on ``D = d t`` workers runs copy ``r`` on workers ``r t .. r t + t - 1`` of its
block. Two rules follow from every unit having links of its own (docs/design.md §3.1):

- **the cut** from copy ``r`` of a stage goes to copy ``r`` of the next, worker ``i`` of
  the one to worker ``i`` of the other, each with a ``1/t`` share of the activation
  (Megatron-LM's scatter/gather, Narayanan et al. 2021, §4.1), the receivers gathering
  the whole over the innermost level; a unit's link carries the shares of the pairs that
  leave it there, so copies on different servers do not share one server's link;
- **the all-reduce** of a split stage runs ``t`` at once, one per tensor rank, each over
  the same rank of every copy: they share each server's outer link, which the hierarchical
  all-reduce of one group would have to itself.

Both are forward and backward alike, the cut ``2 (alpha + share / B)`` a level.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dreampipe.planning.costs import FloatArray
from dreampipe.planning.sync import Sync, allreduce_terms
from dreampipe.planning.topology import Topology

__all__ = ["copy_cut_seconds", "replica_allreduce_terms"]


def copy_cut_seconds(activation_bytes: FloatArray, senders: Sequence[int],
                     receivers: Sequence[int], t: int, topology: Topology) -> FloatArray:
    """Per microbatch of one copy, the cut of ``activation_bytes`` (an array) from the
    stage on ``senders`` to the one on ``receivers`` (their workers in copy order, ``t`` a
    copy); all copies cut at once (module doc)."""
    a = np.asarray(activation_bytes, dtype=np.float64)
    pairs = list(zip(senders, receivers, strict=True))
    worst = np.zeros_like(a)
    size = 1
    for level in topology.levels:
        outer = size * level.count
        crossing = [(s, r) for s, r in pairs if s // outer == r // outer and s // size != r // size]
        if crossing:
            out: dict[int, int] = {}
            into: dict[int, int] = {}
            for s, r in crossing:
                out[s // size] = out.get(s // size, 0) + 1
                into[r // size] = into.get(r // size, 0) + 1
            load = max(*out.values(), *into.values())
            worst = np.maximum(worst, level.latency + load * a / t / level.bandwidth)
        size = outer
    inner = topology.levels[0]
    gather = (t - 1) * (inner.latency + a / t / inner.bandwidth) if t > 1 else 0.0
    return np.asarray(2.0 * (worst + gather))


def replica_allreduce_terms(groups: Sequence[int], t: int, topology: Topology, sync: Sync,
                            replicas: int) -> tuple[float, float]:
    """``(latency s, s per byte)`` of one all-reduce among ``replicas`` laid out as
    ``groups`` (:func:`~dreampipe.planning.sync.replica_groups` of their first workers),
    while the other ``t - 1`` tensor ranks run theirs: every level above the innermost
    gives each group ``1/t`` of a unit's link (module doc)."""
    levels = topology.levels
    if t > 1:
        levels = (levels[0], *(dataclasses.replace(lv, bandwidth=lv.bandwidth / t)
                               for lv in levels[1:]))
    return allreduce_terms(groups, levels, sync, replicas)

"""Coarse profiles for large searches: consecutive layers merged into blocks.

The dynamic program's tables hold every layer range in every context and
unit count (:mod:`dreampipe.planning.dp`); :func:`exact_layers` says how many
layers a topology's tables take within :data:`TABLE_WORK`. A profile with
more layers is planned on :func:`coarsen`'s blocks instead: stages may then
only be cut between blocks, so the plan can be slower than the optimum, and
the planner says by how much at most (:func:`~dreampipe.planning.bounds.
lower_bound`).

The coarse profile's range sums are the fine profile's sums over the blocks'
layers (compute, forward, weights, activations, what a minibatch keeps, the
largest working set) and its cut before a block (and the copy of its input a
stage there runs on) is the fine one there, so a
coarse plan's stages cost what the same stages cost on the fine profile,
except their all-reduce's overlap with the backward, which the coarse
profile sees bucket by block rather than by layer. The planner prices the
plan it returns on the fine profile.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.topology import Topology

__all__ = ["TABLE_WORK", "block_starts", "coarsen", "exact_layers"]

#: The most work the exact search may take: its table entries (contexts x unit counts x
#: ranges, summed over the inner levels) times the square root of the widest inner level's
#: unit count, which tracks the search's time across topologies of one size (128x8, 8x128,
#: 64x16); the budget keeps the exact search to a fraction of a second.
TABLE_WORK = 6_000_000


def exact_layers(topology: Topology) -> int:
    """The most layers the dynamic program plans exactly on ``topology`` within
    :data:`TABLE_WORK`: inner level ``k`` is solved in ``prod(counts above)`` contexts on
    ``count_k + 1`` unit counts over every layer range; the outermost, over suffixes
    only, is left out (a one-level topology: its ``count + 1`` unit counts over
    every suffix and cut)."""
    per_layer2 = 0
    for k, level in enumerate(topology.levels[:-1]):
        contexts = math.prod(lv.count for lv in topology.levels[k + 1:])
        per_layer2 += contexts * (level.count + 1)
    if per_layer2 == 0:
        return max(2, math.isqrt(TABLE_WORK // (topology.levels[-1].count + 1)))
    widest = max(level.count for level in topology.levels[:-1])
    return max(2, math.isqrt(int(TABLE_WORK / (per_layer2 * math.sqrt(widest)))))


def block_starts(prof: RangeCosts, blocks: int) -> list[int]:
    """The first layer of each of at most ``blocks`` blocks of about equal compute.

    Each boundary sits near its compute quantile, on the cut of fewest bytes
    within a quarter of a block of it, so that the coarse plan's cuts are
    cheap ones.
    """
    n = prof.n
    if blocks >= n:
        return list(range(n))
    done = np.cumsum(np.diag(prof.compute_s))
    total = float(done[-1]) if done[-1] > 0 else 1.0
    window = max(1, n // (4 * blocks))
    starts = {0}
    for b in range(1, blocks):
        at = int(np.searchsorted(done, total * b / blocks)) + 1
        lo, hi = max(1, at - window), min(n - 1, at + window)
        if lo > hi:
            continue
        cuts = prof.cut_bytes[lo:hi + 1]
        starts.add(lo + int(np.argmin(cuts)))
    return sorted(starts)


def coarsen(prof: RangeCosts, starts: Sequence[int]) -> RangeCosts:
    """``prof`` over the blocks that begin at ``starts`` (module doc)."""
    first = np.asarray(starts, dtype=np.int64)
    last = np.append(first[1:] - 1, prof.n - 1)
    backward, weights = prof.layer_backward_s, prof.layer_weights
    assert backward is not None and weights is not None

    def pick(table: np.ndarray | None) -> np.ndarray | None:
        return None if table is None else np.asarray(table[np.ix_(first, last)])

    def sums(values: np.ndarray) -> np.ndarray:
        return np.add.reduceat(values, first)

    compute = pick(prof.compute_s)
    assert compute is not None
    return RangeCosts(
        compute, np.asarray(pick(prof.weights)), np.asarray(pick(prof.activations)),
        np.asarray(prof.cut_bytes[first]), forward_s=pick(prof.forward_s),
        layer_backward_s=sums(backward), layer_weights=sums(weights),
        stashed=pick(prof.stashed), working=pick(prof.working), optimizer=prof.optimizer,
        copied=None if prof.copied is None else np.asarray(prof.copied[first]),
    )

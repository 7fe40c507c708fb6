"""Floors of the synchronous search: times no plan of a choice beats, from the envelope.

A stage's ``tau`` is at least its compute (recomputation and ZeRO's collectives only
add), so a stage holding layers ``i..j`` or more takes at least the envelope
``E[i, j]``: the least over the options of the compute of any range containing
``i..j`` (:func:`envelope`). ``E`` grows with ``j`` and shrinks with ``i``, so stages
whose ``E`` stays within a bound cover the layers in the fewest stages when each is as
long as it may be, greedily; bisecting that bound gives a floor on the largest stage of
any ``count`` stages (:func:`least_largest`), and with the least cut added to every
stage but the last (:func:`least_largest_with_cut`). A stage whose ``E`` reaches the
time to beat is in no faster plan: :func:`band_width` is the most layers one may hold.
What memory forces bounds the stages' summed ``tau`` from below: each layer's option
and ZeRO level pays time and memory (:func:`option_floors`), and the least time whose
memory fits is bounded by its Lagrangian dual (:func:`least_stage_sum`,
:func:`least_within`). docs/planner.md, "The synchronous objective".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dreampipe.planning.costs import FloatArray, RangeCosts
from dreampipe.planning.split_ranges import StageSplit
from dreampipe.planning.sync_stage_option import Recompute, StageOption
from dreampipe.planning.triangle import upper
from dreampipe.planning.zero_terms import SHARDED_LEVEL

__all__ = [
    "OptionFloors",
    "Reach",
    "band_width",
    "envelope",
    "layer_floors",
    "least_largest",
    "least_largest_with_cut",
    "least_layers",
    "least_stage_sum",
    "least_sum",
    "least_within",
    "option_floors",
    "scaled_computes",
]

#: Bisection stops within this share of its upper end, and keeps the lower.
_PRECISION = 1e-3
#: Bisection steps of :func:`least_within`'s multiplier, over decades.
_DUAL_STEPS = 14
#: Up to this many stages, a greedy cover reads its rows' reach one by one; past it,
#: :meth:`Reach.reach` reads every row's at once.
_ROW_BY_ROW = 8


def scaled_computes(whole: RangeCosts, splits: Iterable[StageSplit | None]
                    ) -> list[FloatArray]:
    """Each option's compute ``[i, j]`` (``whole``'s, or a split's) without the part a
    microbatch does not scale: a split's collectives' message latencies
    (:meth:`StageSplit.at_fraction`), so that a floor stays below a microbatch of any size."""
    return [whole.compute_s if s is None else s.costs.compute_s - _latencies(s)
            for s in splits]


def least_layers(whole: RangeCosts, splits: Iterable[StageSplit | None]) -> float:
    """A floor on the sum of a pipeline's stages' compute for a profiled minibatch: each
    layer's least over the options (``whole``'s, or a split's), which every stage sums at
    least (:func:`layer_floors`)."""
    return float(np.sum(np.min(np.stack([layer_floors(whole, s)[0] for s in splits]),
                               axis=0)))


def layer_floors(whole: RangeCosts, split: StageSplit | None
                 ) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Each layer's floor on its compute and on its forward for a profiled minibatch, run
    unsplit (``whole``'s) or as ``split``, its collectives' message latencies left out,
    and those latencies (a stage's compute at any microbatch sums at least its layers'
    floors at that microbatch and their latencies). A split layer inside a stage takes its
    own time (:attr:`StageSplit.own`; the reshards around it only add); a layer alone
    also pays its stage's entry and exit, which a longer stage shares: its share of the
    unsplit layer is a floor then."""
    forward = np.diag(whole.forward)
    alone = forward + np.asarray(whole.layer_backward_s)
    if split is None:
        return alone, forward, np.zeros_like(alone)
    c = split.costs
    latency = np.diag(_latencies(split))
    own_forward = np.diag(c.forward) - np.diag(_forward_latencies(split))
    own = np.diag(c.forward) + np.asarray(c.layer_backward_s) - latency
    compute = np.minimum(np.maximum(0.0, own), alone / split.t)
    inside = np.zeros_like(alone)
    if split.own is not None:
        timed, inside = split.own
        compute = np.maximum(compute, timed - inside)
    return compute, np.minimum(np.maximum(0.0, own_forward), forward / split.t), inside


@dataclass(frozen=True)
class OptionFloors:
    """One stage option's floors, layer by layer, for a profiled minibatch: its compute
    and the forward it runs again (:func:`layer_floors`), their collectives' latencies,
    its weights, and what it keeps per microbatch it holds and once."""

    compute: FloatArray
    again: FloatArray
    latency: FloatArray
    weights: FloatArray
    per_held: FloatArray
    once: FloatArray


def option_floors(whole: RangeCosts, option: StageOption, blocks: Sequence[int | None]
                  ) -> OptionFloors:
    """:class:`OptionFloors` of ``option``: a stage that recomputes whole runs each
    layer's forward again and keeps its tensors once; block by block, it keeps a block's
    input at its first layer (of ``blocks``, each layer's block or None) and what the
    layers outside blocks keep, and where every block is recomputed, runs each block
    layer's forward again (the lesser of a block layer's tensors and input where fewer
    are); otherwise a stage keeps its tensors per microbatch."""
    costs = whole if option.split is None else option.split.costs
    compute, forward, latency = layer_floors(whole, option.split)
    kept, none = np.diag(costs.kept), np.zeros_like(compute)
    if option.recompute is Recompute.NONE:
        return OptionFloors(compute, none, latency, np.diag(costs.weights), kept, none)
    if option.recompute is Recompute.STAGE:
        return OptionFloors(compute, forward, latency, np.diag(costs.weights), none, kept)
    inside = np.array([b is not None for b in blocks])
    first = inside & np.array([k == 0 or blocks[k - 1] != b for k, b in enumerate(blocks)])
    entry = np.where(first, whole.cut_bytes, 0.0)
    if option.blocks >= len({b for b in blocks if b is not None}):
        return OptionFloors(compute, np.where(inside, forward, 0.0), latency,
                            np.diag(costs.weights), np.where(inside, entry, kept), none)
    return OptionFloors(compute, none, latency, np.diag(costs.weights),
                        np.where(inside, np.minimum(kept, entry), kept), none)


def least_stage_sum(floors: Sequence[OptionFloors], state: dict[int, float], per: float,
                    fraction: float, held: int, room: float) -> float:
    """A floor on the sum of the ``tau`` of a pipeline's stages, microbatches ``fraction``
    of the profiled one, each stage holding ``held`` or more, whose memory sums to at most
    ``room``: each layer runs as one of the options (their ``floors``) at one ZeRO level
    ``z`` (``state``: bytes of state a byte of weights keeps there), which adds to the sum
    at least its compute, its forward again and, at level 3, its gathers (``per`` seconds
    a byte, an all-reduce's bytes), and to the memory at least its weights' state and what
    it keeps; :func:`least_within` bounds the least."""
    times, memory = [], []
    for o in floors:
        work = (o.compute + o.again) * fraction + o.latency
        kept = (o.per_held * held + o.once) * fraction
        for z, per_byte in state.items():
            times.append(work + (per * o.weights if z >= SHARDED_LEVEL else 0.0))
            memory.append(o.weights * per_byte + kept)
    return least_within(np.stack(times), np.stack(memory), room)


_EPS = float(np.finfo(np.float64).eps)


def least_within(times: FloatArray, memory: FloatArray, room: float) -> float:
    """A floor on ``sum_l times[o_l, l]`` over every choice of a row ``o_l`` for each layer
    ``l`` whose ``sum_l memory[o_l, l]`` is at most ``room``: the Lagrangian dual
    ``max over y >= 0 of sum_l min_o (times + y memory) - y room``, which any ``y`` bounds
    from below (weak duality); ``inf`` where even the leanest rows exceed ``room``."""
    leanest = float(np.sum(np.min(memory, axis=0)))
    if leanest > room:
        return math.inf
    best = float(np.sum(np.min(times, axis=0)))
    if float(np.sum(memory[np.argmin(times, axis=0), np.arange(times.shape[1])])) <= room:
        return best  # the fastest rows fit
    cols = np.arange(times.shape[1])
    lo, hi = -20.0, 0.0  # log10 of y: bisect where the rows' memory crosses room
    while float(np.sum(memory[np.argmin(times + 10.0 ** hi * memory, axis=0), cols])) > room:
        lo, hi = hi, hi + 10.0
    for _ in range(_DUAL_STEPS):
        y = 10.0 ** ((lo + hi) / 2)
        priced = times + y * memory
        pick = np.argmin(priced, axis=0)
        took = priced[pick, cols]
        # less the rounding of a sum of large terms that cancel (weak duality holds exactly)
        slack = (len(cols) + 2) * _EPS * (float(np.sum(np.abs(took))) + y * room)
        best = max(best, float(np.sum(took)) - y * room - slack)
        if float(np.sum(memory[pick, cols])) > room:
            lo = (lo + hi) / 2
        else:
            hi = (lo + hi) / 2
    return best


def least_sum(whole: RangeCosts, splits: Iterable[StageSplit | None],
              field: Callable[[RangeCosts], FloatArray]) -> float:
    """A floor on what a pipeline's stages hold together of a quantity that adds over
    layers (``field`` of a cost table, ``[i, j]``: the weights, the kept bytes): each
    layer's least over the options (``whole``'s, or a split's)."""
    per_layer = [np.diag(field(whole if s is None else s.costs)) for s in splits]
    return float(np.sum(np.min(np.stack(per_layer), axis=0)))


def envelope(computes: Sequence[FloatArray]) -> FloatArray:
    """``[i, j]``: the least, over the ``computes`` tables and the ranges containing
    ``i..j``, of a range's compute (inf where ``j < i``)."""
    least = np.min(np.stack(list(computes)), axis=0)
    above = np.minimum.accumulate(least[:, ::-1], axis=1)[:, ::-1]
    out = np.minimum.accumulate(above, axis=0)
    return np.asarray(np.where(upper(out.shape[0]), out, np.inf))


class Reach:
    """How many layers a stage from each layer may hold while its :func:`envelope` entry
    stays within a bound, for every layer at once. The entries become their exact ranks
    among the envelope's values, each row's after the row before in one sorted array, so
    one ``searchsorted`` answers every row, with no rounding."""

    def __init__(self, env: FloatArray) -> None:
        n = env.shape[0]
        self.env = env
        finite = np.isfinite(env)
        self._values, ranks = np.unique(env[finite], return_inverse=True)
        codes = np.full(env.shape, len(self._values), dtype=np.int64)  # inf: past every value
        codes[finite] = ranks
        codes[~upper(n)] = -1  # before the stage's first layer: below any bound
        rows = np.arange(n, dtype=np.int64)
        self._offsets = rows * (len(self._values) + 2)  # rows apart, each in its own span
        self._flat = (codes + 1 + self._offsets[:, None]).ravel()
        self._before = rows * n + rows  # flat entries before row i, and row i's left part
        self._reach: dict[int, list[int]] = {}

    def reach(self, theta: float) -> list[int]:
        """``[i]``: how many layers from layer ``i`` on a stage may hold while its
        :func:`envelope` entry is at most ``theta`` (shared: read only). Bounds between the
        same two values reach alike, so each rank's is made once (the floors' bisections
        come back to a few)."""
        ranked = int(np.searchsorted(self._values, theta, side="right"))  # values <= theta
        if ranked not in self._reach:
            ends = np.searchsorted(self._flat, self._offsets + ranked, side="right")
            self._reach[ranked] = list((ends - self._before).tolist())
        return self._reach[ranked]

    def stages_within(self, theta: float, most: int) -> float:
        """The fewest stages, each of :func:`envelope` at most ``theta``, that cover the
        layers (inf: a layer alone is above it), or ``most + 1`` when more than ``most``."""
        reach = self.reach(theta)
        n, i, count = len(reach), 0, 0
        while i < n:  # greedy: no stages reach further
            if count == most:
                return most + 1
            if reach[i] == 0:
                return math.inf
            i, count = i + reach[i], count + 1
        return count


def least_largest(reach: Reach, count: int, lo: float) -> float:
    """A floor on the largest :func:`envelope` entry of ``count`` stages covering the
    layers, given a floor ``lo`` on it."""
    env = reach.env
    hi = lo + float(np.max(np.diag(env)))  # enough for sums; checked, else all layers
    if not reach.stages_within(hi, count) <= count:
        hi = float(env[0, -1])
    return _bisect(lo, hi, lambda theta: reach.stages_within(theta, count) <= count)


def least_largest_with_cut(reach: Reach, fraction: float, cut: float, count: int,
                           lo: float) -> float:
    """A floor on the largest ``fraction * E + cut`` of ``count`` stages covering the
    layers (the last without its cut), given a floor ``lo`` on it."""
    env = reach.env
    n = env.shape[0]

    def fits(theta: float) -> bool:
        bound = (theta - cut) / fraction
        ahead = reach.reach(bound) if count > _ROW_BY_ROW else None  # else row by row
        i = 0
        for _ in range(count - 1):  # greedy: no stages reach further
            if i >= n:
                return True
            k = ahead[i] if ahead is not None else int(
                env[i, i:].searchsorted(bound, side="right"))
            if k == 0:
                break
            i += k
        return i >= n or float(env[i, n - 1]) * fraction <= theta

    return _bisect(lo, float(env[0, -1]) * fraction + cut, fits)


def band_width(env: FloatArray, theta: float) -> int:
    """The most layers a stage may hold while its :func:`envelope` stays below ``theta``."""
    if not math.isfinite(theta):
        return int(env.shape[0])
    return max(1, int(np.max(np.sum(env < theta, axis=1))))


def _bisect(lo: float, hi: float, fits: Callable[[float], bool]) -> float:
    """The largest bound found below which ``fits`` fails, from ``lo`` (below the least
    that fits) and ``hi`` (one that fits)."""
    if not math.isfinite(hi) or hi <= lo:
        return lo
    while hi - lo > _PRECISION * hi:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo


def _latencies(split: StageSplit) -> FloatArray:
    """A split's collectives' message latencies ``[i, j]`` (zeros without)."""
    return (np.zeros_like(split.costs.compute_s) if split.latencies is None
            else split.latencies[0])


def _forward_latencies(split: StageSplit) -> FloatArray:
    """The forward's part of :func:`_latencies`."""
    return (np.zeros_like(split.costs.compute_s) if split.latencies is None
            else split.latencies[1])

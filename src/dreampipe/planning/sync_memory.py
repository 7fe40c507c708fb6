"""What a stage of a synchronous plan holds, for every layer range and every way to run it.

:class:`StageMemory` is the memory side of
:class:`~dreampipe.planning.sync_tables.StageTables`: each option's bytes per worker over
layer ranges ``[i, j]`` (or a band of them, :func:`~dreampipe.planning.sync_bands.band`)
as ``fixed + held * per``, its ZeRO level's state on its activations
(:class:`~dreampipe.planning.state_bytes.Training`'s bytes), and the most microbatches a
stage holds within a limit. What does not depend on the level is read once for an
option's twins, and what does not depend on how it recomputes once for its split's
options. docs/planner.md, "The synchronous objective".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from dreampipe.planning.costs import FloatArray, RangeCosts
from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync_bands import band, capacity_of, edge, edge_size, pick, row_sums
from dreampipe.planning.sync_stage_option import (
    Recompute,
    StageOption,
    block_mask,
    recomputed_peak,
    twin_bases,
)
from dreampipe.planning.triangle import upper
from dreampipe.planning.zero_terms import SHARDED_LEVEL

__all__ = ["StageMemory"]

IntArray = npt.NDArray[np.int64]


class StageMemory:
    """The options' memory over the layer ranges of ``costs`` (a split's own where it has
    one) for microbatches of ``fraction`` of the profiled minibatch on ``d`` replicas:
    ``training``'s state for weights profiled at ``param_bytes`` a weight, ``blocks``
    each layer's block (module doc)."""

    def __init__(self, costs: RangeCosts, training: Training, param_bytes: float,
                 blocks: tuple[int | None, ...], options: Sequence[StageOption], d: int,
                 fraction: float) -> None:
        self.costs, self.training, self.param_bytes = costs, training, param_bytes
        self.blocks, self.options, self.d, self.fraction = blocks, tuple(options), d, fraction
        self.n = costs.n
        self._base = twin_bases(self.options)
        self._split = twin_bases(self.options, by_split=True)
        self._twins = len(set(self._split)) < len(self._split)
        self._sharded = d > 1 and any(o.zero >= SHARDED_LEVEL for o in self.options)
        #: each option's band capacity within each room, as wide as read so far, and its
        #: edges' (:meth:`edge_capacity`)
        self._capacities: dict[tuple[int, float], FloatArray] = {}
        self._edge_capacities: dict[tuple[int, float, bool], FloatArray] = {}

    def memory(self, x: int, held: float) -> FloatArray:
        """``[i, j]``: bytes per worker of option ``x`` holding ``held`` microbatches."""
        fixed, per = self._memory(x, *band(self.n, None))
        return np.asarray(fixed + held * per)

    def memory_at(self, x: int, held: float, first: int, last: int) -> float:
        """:meth:`memory` of the one stage ``first..last``."""
        fixed, per = self._memory(x, first, last)
        return float(fixed + held * per)

    def capacity(self, x: int, room: float, width: int | None = None) -> FloatArray:
        """``[i, j]`` (with ``width``, ``[i, k]`` as :func:`~dreampipe.planning.sync_bands.
        band`): the most microbatches option ``x`` holds within ``room`` bytes per worker
        (-1 where not even none fit, inf where they cost nothing): a stage fits holding
        ``held`` exactly where ``held <= capacity``."""
        if width is None:
            return self._square_capacity(x, room)
        # a band's entries do not depend on its width: a wider one adds only its new columns
        have = self._capacities.get((x, room))
        if have is None or have.shape[1] < width:
            done = 0 if have is None else have.shape[1]
            new = capacity_of(*self._band_memory(x, width, done), room)
            have = new if have is None else np.concatenate((have, new), axis=1)
            self._capacities[x, room] = have
        return have if have.shape[1] == width else have[:, :width]

    @functools.lru_cache(maxsize=16)  # noqa: B019 - per instance, dropped with it
    def _square_capacity(self, x: int, room: float) -> FloatArray:
        return capacity_of(*self._band_memory(x, None), room)

    def fits(self, x: int, held: int, room: float, first: int, last: int) -> bool:
        """Whether a stage ``first..last`` run as option ``x`` fits ``room`` holding
        ``held`` microbatches (:meth:`capacity`, for one stage)."""
        fixed, per = (float(a) for a in self._memory(x, first, last))
        if fixed > room:  # :func:`capacity_of` on one stage, in plain floats
            return False
        return per <= 0 or math.floor((room - fixed) / per) >= held

    def _band_memory(self, x: int, width: int | None, start: int = 0
                     ) -> tuple[FloatArray, FloatArray]:
        """:meth:`_memory` of a band's columns from ``start`` (:func:`band`)."""
        if not self._twins:  # nothing to share: keep no copy
            return self._memory(x, *band(self.n, width, start))
        return self._at_zero(x, *self._band_parts(self._base[x], width, start))

    @functools.lru_cache(maxsize=4)  # noqa: B019 - twins are read one after another
    def _band_parts(self, x: int, width: int | None, start: int) -> _MemoryParts:
        kept = self.options[x].recompute is not Recompute.BLOCKS
        return self._parts(x, *band(self.n, width, start),
                           reads=self._band_reads(self._split[x], width, start, kept))

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a split's options are read one after another
    def _band_reads(self, x: int, width: int | None, start: int, kept: bool) -> _Reads:
        return self._reads(x, *band(self.n, width, start), kept)

    def _memory(self, x: int, rows: IntArray | int, last: IntArray | int
                ) -> tuple[FloatArray, FloatArray]:
        """Option ``x``'s memory terms ``(fixed, per)`` of the stages ``rows..last`` (index
        arrays of one shape, or one stage's first and last layer): ``fixed + held * per``
        bytes, its ZeRO level's state on its activations."""
        return self._at_zero(x, *self._parts(self._base[x], rows, last))

    def _parts(self, x: int, rows: IntArray | int, last: IntArray | int,
               reads: _Reads | None = None) -> _MemoryParts:
        """What :meth:`_memory` reads at any ZeRO level: ``(fixed, per)`` of the
        activations, the weights' bytes and the largest layer's (0 where no option
        shards at level 3); ``x`` is an option's first twin but for its ZeRO level;
        ``reads``: :meth:`_reads`, where made already."""
        o = self.options[x]
        blocks = o.recompute is Recompute.BLOCKS
        r = reads or self._reads(x, rows, last, not blocks)
        if blocks:
            fixed, per = self._activations(x)
            return pick(fixed, rows, last), pick(per, rows, last), r.weights, r.largest
        assert r.fixed is not None and r.kept is not None and r.first is not None
        if o.recompute is Recompute.NONE:
            return r.fixed, r.first + r.kept, r.weights, r.largest
        return r.fixed + r.first + r.kept, r.first, r.weights, r.largest

    def _reads(self, x: int, rows: IntArray | int, last: IntArray | int, kept: bool) -> _Reads:
        """What :meth:`_parts` reads of option ``x``'s split's costs, the same for every way
        it recomputes: the weights' bytes, the largest layer's (0 where no option shards
        at level 3) and with ``kept``, at the microbatch, what a stage holds besides, what
        a microbatch keeps and its input."""
        costs = self._costs(self.options[x])
        weights = pick(costs.weights, rows, last)
        largest = pick(costs.largest_weights, rows, last) if self._sharded else 0.0
        if not kept:
            return _Reads(weights, largest)
        f = self.fraction  # indexed before scaled, as :meth:`_activations` would scale them
        fixed = pick(costs.held_besides, rows, last) * f
        # a stage's input is the cut before its first layer (``rows`` has ``last``'s shape)
        return _Reads(weights, largest, fixed, pick(costs.stage_kept, rows, last) * f,
                      costs.cut_bytes[np.asarray(rows)] * f)

    def _at_zero(self, x: int, fixed: FloatArray, per: FloatArray, weights: FloatArray,
                 largest: FloatArray | float) -> tuple[FloatArray, FloatArray]:
        """:meth:`_memory` from :meth:`_parts`, at option ``x``'s ZeRO level."""
        level = self.options[x].zero
        state = weights * self.training.state_per_byte(self.param_bytes, level, self.d)
        if level >= SHARDED_LEVEL and self.d > 1:  # one layer gathered whole at a time
            state = state + largest
        return fixed + state, per

    @functools.lru_cache(maxsize=64)  # noqa: B019 - per instance, dropped with it
    def _activations(self, x: int) -> tuple[FloatArray, FloatArray]:
        """Option ``x``'s memory terms ``[i, j]`` without its weights' state, where it
        recomputes block by block (:meth:`_parts` makes the others' for the stages read)."""
        f, o = self.fraction, self.options[x]
        costs = self._costs(o)
        # a microbatch keeps its input, and the copy of it a first layer that writes it
        # runs on (:func:`~dreampipe.planning.memory_terms.input_copies`)
        fixed, first = costs.held_besides * f, (costs.inputs + costs.copies[:, None]) * f
        mask = block_mask(self.blocks, o.blocks)
        layer_kept = np.diag(costs.kept) * f
        later = upper(self.n)
        rest = row_sums(np.where(later & ~mask, layer_kept[None, :], 0.0))
        starts = np.asarray([False] + [b is not None and b != a for a, b in
                                       zip(self.blocks, self.blocks[1:], strict=False)])
        # a block's input kept for it, where the layer before is recomputed too: a layer kept
        # whole keeps its output already (Layer.saved_bytes)
        after = np.pad(mask[:, :-1], ((0, 0), (1, 0)))
        entry = np.where(mask & after & starts[None, :] & upper(self.n, 1),
                         self.costs.cut_bytes[None, :] * f, 0.0)
        return (fixed + recomputed_peak(self.blocks, layer_kept, o.blocks),
                first + rest + row_sums(entry))

    def edge_capacity(self, x: int, room: float, width: int, last_slot: bool) -> FloatArray:
        """:meth:`capacity` of the stages a pipeline's first slot (or ``last_slot``) may take
        alone (:func:`~dreampipe.planning.sync_bands.edge`), widened as a band is."""
        size, axis = edge_size(self.n, width, last_slot), 0 if last_slot else 1
        have = self._edge_capacities.get((x, room, last_slot))
        if have is None or have.shape[axis] < size:
            done = 0 if have is None else have.shape[axis]
            new = capacity_of(*self._at_zero(x, *self._edge_parts(self._base[x], size,
                                                                  last_slot, done)), room)
            have = new if have is None else np.concatenate(
                (new, have) if last_slot else (have, new), axis=axis)
            self._edge_capacities[x, room, last_slot] = have
        if have.shape[axis] == size:
            return have
        return have[-size:] if last_slot else have[:, :size]

    @functools.lru_cache(maxsize=16)  # noqa: B019 - per instance, dropped with it
    def _edge_parts(self, x: int, width: int, last_slot: bool, start: int) -> _MemoryParts:
        rows, last, _ = edge(self.n, width, last_slot, start)
        return self._parts(x, rows, last)

    def _costs(self, o: StageOption) -> RangeCosts:
        return self.costs if o.split is None else o.split.costs


_MemoryParts = tuple[FloatArray, FloatArray, FloatArray, FloatArray | float]


class _Reads(NamedTuple):
    """:meth:`StageMemory._reads`: ``fixed``, ``kept`` and ``first`` only where read."""

    weights: FloatArray
    largest: FloatArray | float
    fixed: FloatArray | None = None
    kept: FloatArray | None = None
    first: FloatArray | None = None

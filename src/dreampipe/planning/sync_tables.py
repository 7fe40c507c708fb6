"""What a stage of a synchronous plan costs, for every layer range and every way to run it.

A :class:`StageOption` is one way to run a stage: split over the ``t`` workers of a
replica or not, keeping its activations, recomputing them whole or recomputing its
first ``k`` blocks. These options are the one place where a stage's choices are listed;
each gets tables over layer ranges ``[i, j]`` for a microbatch of ``b`` samples on ``d``
replicas (:class:`StageTables`): ``tau`` the microbatch's forward and backward
(recomputation and ZeRO's per-microbatch collectives included), ``tail`` what the update
adds after its last backward, and memory as ``fixed + held * per``
(:mod:`~dreampipe.planning.sync_memory`). The terms are the planner's
(:mod:`dreampipe.planning.costs`): times scale with the microbatch (less than in
proportion where the profile measured a fixed part a call), the all-reduce is
:func:`~dreampipe.planning.costs.allreduce_end` on its replicas' layout, ZeRO's times
:func:`~dreampipe.planning.zero_terms.zero_times` (:mod:`~dreampipe.planning.sync_levels`)
and its bytes :class:`~dreampipe.planning.state_bytes.Training`'s. docs/planner.md, "The
synchronous objective".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dreampipe.planning.costs import (
    FloatArray,
    RangeCosts,
)
from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync import Sync, replica_groups
from dreampipe.planning.sync_bands import (
    band,
    band_allreduce_ends,
    edge,
    edge_size,
    pick,
)
from dreampipe.planning.sync_levels import LevelFree, at_level
from dreampipe.planning.sync_links import copy_cut_seconds, replica_allreduce_terms
from dreampipe.planning.sync_memory import StageMemory
from dreampipe.planning.sync_stage_option import (
    Recompute,
    StageOption,
    block_mask,
    block_span,
    twin_bases,
)
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph

__all__ = ["StageTables", "TableInputs", "block_groups"]

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class TableInputs:
    """What the tables of one setting read: the profile (weights as trained), its
    tensor splits, the cluster, the all-reduce, the training's bytes, the bytes a weight
    takes in the profile, each layer's block and weight-gradient share."""

    graph: LayerGraph
    costs: RangeCosts
    topology: Topology
    sync: Sync
    training: Training
    profiled_param_bytes: float
    blocks: tuple[int | None, ...]
    weight_grad_share: tuple[float, ...]


class StageTables:
    """The options' tables for ``t`` workers a replica, ``d`` replicas, microbatches of
    ``fraction`` of the profiled minibatch (module doc), each option at its ZeRO level;
    ``splits_backward``: the schedule runs ``W`` apart from ``B``. A stage on worker
    block ``k`` holds workers ``k D .. (k + 1) D - 1``, ``D = d t``, replica ``r`` from
    ``k D + r t``."""

    def __init__(self, inputs: TableInputs, options: Sequence[StageOption], t: int, d: int,
                 fraction: float, splits_backward: bool = False) -> None:
        self.inputs, self.options, self.t, self.d = inputs, tuple(options), t, d
        self.fraction, self.splits_backward = fraction, splits_backward
        self.n = inputs.costs.n
        #: each option's first twin but for its ZeRO level: what does not depend on the
        #: level (compute, activations, the all-reduce's end) is made once for all twins;
        #: and its first option of the same split, which reads the same ranges' costs
        self._base = twin_bases(self.options)
        self._split = twin_bases(self.options, by_split=True)
        self._twins = len(set(self._split)) < len(self._split)
        #: each option's band times on each replica layout, as wide as read so far, and
        #: its edges' (:meth:`edge_times`)
        self._bands: dict[tuple[int, tuple[int, ...]], _Times] = {}
        #: what :meth:`groups` and :meth:`cut` made, kept with the tables (a cache on the
        #: method would keep the tables alive)
        self._groups: dict[int, tuple[int, ...]] = {}
        self._cuts: dict[tuple[int, int], FloatArray] = {}
        self._edges: dict[tuple[int, tuple[int, ...], bool], _Times] = {}
        self._memory = StageMemory(inputs.costs, inputs.training, inputs.profiled_param_bytes,
                                   inputs.blocks, self.options, d, fraction)

    # ---- layout ------------------------------------------------------------------
    def workers(self, block: int) -> tuple[int, ...]:
        """Every worker of the stage on worker block ``block``."""
        size = self.d * self.t
        return tuple(range(block * size, (block + 1) * size))

    def groups(self, block: int) -> tuple[int, ...]:
        """How the replicas of the stage on ``block`` sit in the topology: blocks with the
        same groups have the same times."""
        if block not in self._groups:
            self._groups[block] = block_groups(block, self.d, self.t, self.inputs.topology)
        return self._groups[block]

    # ---- time --------------------------------------------------------------------
    def times(self, x: int, block: int, width: int | None = None
              ) -> tuple[FloatArray, FloatArray, FloatArray]:
        """``(tau, tail, weight gradient)`` of option ``x`` on worker block ``block`` (module
        doc), ``[i, j]``;
        with ``width``, ``[i, k]`` for the stage of layers ``i..i + k``, ``k < width``
        (:func:`band`; entries past the last layer are the last layer's)."""
        return self._times(x, self.groups(block), width)

    def time_at(self, x: int, block: int, first: int, last: int
                ) -> tuple[float, float, float]:
        """:meth:`times` of the one stage ``first..last``."""
        ends = np.arange(first, last + 1)[None, :]  # the all-reduce's end runs over them
        tau, tail, wgrad = self._priced(x, self.groups(block), np.full_like(ends, first), ends)
        return float(tau[0, -1]), float(tail[0, -1]), float(wgrad[0, -1])

    def edge_times(self, x: int, block: int, width: int, last_slot: bool
                   ) -> tuple[FloatArray, FloatArray, FloatArray]:
        """:meth:`times` of the stages a pipeline's first slot (or ``last_slot``) may take
        alone (:func:`~dreampipe.planning.sync_bands.edge`): a slot that reads no more
        makes no band."""
        # as a band: each stage's entry is its own, so a wider edge adds only its new stages
        # (the first slot's columns after, the last slot's rows before)
        groups, size = self.groups(block), edge_size(self.n, width, last_slot)
        have = self._edges.get((x, groups, last_slot))
        axis = 0 if last_slot else 1
        if have is None or have[0].shape[axis] < size:
            done = 0 if have is None else have[0].shape[axis]
            new = self._at_level(x, self._edge_terms(self._base[x], groups, size, last_slot,
                                                     done))
            have = new if have is None else _joined(*((new, have) if last_slot else
                                                      (have, new)), axis=axis)
            self._edges[x, groups, last_slot] = have
        if have[0].shape[axis] == size:
            return have
        if last_slot:
            return have[0][-size:], have[1][-size:], have[2][-size:]
        return have[0][:, :size], have[1][:, :size], have[2][:, :size]

    @functools.lru_cache(maxsize=4)  # noqa: B019 - twins are read one after another
    def _edge_terms(self, x: int, groups: tuple[int, ...], width: int, last_slot: bool,
                    start: int) -> LevelFree:
        rows, last, _ = edge(self.n, width, last_slot, start)
        return self._terms(x, groups, rows, last, last_slot, start=0 if last_slot else start)

    def _times(self, x: int, groups: tuple[int, ...], width: int | None
               ) -> tuple[FloatArray, FloatArray, FloatArray]:
        if width is None:
            return self._square_times(x, groups)
        # a band's entries do not depend on its width: a wider one adds only its new columns
        have = self._bands.get((x, groups))
        if have is None or have[0].shape[1] < width:
            done = 0 if have is None else have[0].shape[1]
            new = self._at_level(x, self._band_terms(self._base[x], groups, width, done)
                                 if self._twins else  # nothing to share: keep no copy
                                 self._terms(self._base[x], groups, *band(self.n, width, done),
                                            start=done))
            have = new if have is None else _joined(have, new)
            self._bands[x, groups] = have
        if have[0].shape[1] == width:
            return have
        return have[0][:, :width], have[1][:, :width], have[2][:, :width]

    @functools.lru_cache(maxsize=16)  # noqa: B019 - per instance, dropped with it
    def _square_times(self, x: int, groups: tuple[int, ...]
                      ) -> tuple[FloatArray, FloatArray, FloatArray]:
        if not self._twins:
            return self._at_level(x, self._terms(self._base[x], groups, *band(self.n, None)))
        return self._at_level(x, self._band_terms(self._base[x], groups, None))

    @functools.lru_cache(maxsize=4)  # noqa: B019 - twins are read one after another
    def _band_terms(self, x: int, groups: tuple[int, ...], width: int | None, start: int = 0
                    ) -> LevelFree:
        """:meth:`_terms` of a band's columns from ``start`` (:func:`band`), made once for
        ``x``'s twins."""
        rows, last = band(self.n, width, start)
        return self._terms(x, groups, rows, last,
                           common=self._band_common(self._split[x], groups, width, start))

    @functools.lru_cache(maxsize=2)  # noqa: B019 - a split's options are read one after another
    def _band_common(self, x: int, groups: tuple[int, ...], width: int | None, start: int
                     ) -> _Common:
        return self._common(x, groups, *band(self.n, width, start), start=start)

    def _priced(self, x: int, groups: tuple[int, ...], rows: IntArray, last: IntArray,
                is_column: bool = False) -> tuple[FloatArray, FloatArray, FloatArray]:
        """``(tau, tail, weight gradient)`` of the stages ``rows..last`` (index arrays of
        one shape) at option ``x``'s ZeRO level."""
        return self._at_level(x, self._terms(self._base[x], groups, rows, last, is_column))

    def _terms(self, x: int, groups: tuple[int, ...], rows: IntArray, last: IntArray,
               is_column: bool = False, common: _Common | None = None, start: int = 0
               ) -> LevelFree:
        """What option ``x``'s stages ``rows..last`` cost at any ZeRO level
        (:class:`~dreampipe.planning.sync_levels.LevelFree`); ``x`` is the first of its
        twins, so that what no level changes is made once for them; ``common``:
        :meth:`_common`, where made already; ``start``: :meth:`_common`'s."""
        forward, compute, end, ar, wgrad = common or self._common(x, groups, rows, last,
                                                                  is_column, start)
        again = self._again(x, rows, last, forward)
        return LevelFree.of(forward, compute, again, end, ar, wgrad)

    def _common(self, x: int, groups: tuple[int, ...], rows: IntArray, last: IntArray,
                is_column: bool = False, start: int = 0) -> _Common:
        """What :meth:`_terms` reads that depends only on option ``x``'s split, the same for
        every way it recomputes: ``(forward, compute, all-reduce end, all-reduce, weight
        gradients)``; ``start``: the stages are a band's columns from ``start`` on."""
        costs = self._costs(self.options[x])
        compute, forward = self._at_fraction(x, rows, last)
        weights = pick(costs.weights, rows, last)
        lat, per = replica_allreduce_terms(groups, self.t, self.inputs.topology,
                                           self.inputs.sync, self.d)
        backward, weighed, made = self._prefix_sums(x)
        if self.d > 1:
            end = band_allreduce_ends(backward, weighed, lat, per,
                                      self.inputs.topology.overlap, rows, last, is_column,
                                      start)
            ar = per * weights  # lat + per * weights where there are weights, else 0
            ar += lat
            np.copyto(ar, 0.0, where=~(weights > 0))
        else:
            end = ar = np.zeros_like(compute)
        wgrad = made[last + 1] - made[rows]  # 0 before a stage's first layer
        np.copyto(wgrad, 0.0, where=~(last >= rows))
        return forward, compute, end, ar, wgrad

    def _at_level(self, x: int, terms: LevelFree) -> tuple[FloatArray, FloatArray, FloatArray]:
        """``(tau, tail, weight gradient)`` of :meth:`_terms` at option ``x``'s ZeRO level
        (:func:`~dreampipe.planning.sync_levels.at_level`)."""
        return at_level(terms, self.options[x].zero, self.d, self.splits_backward)

    @functools.lru_cache(maxsize=16)  # noqa: B019 - per instance, dropped with it
    def _prefix_sums(self, x: int) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Option ``x``'s sums over its first layers (0 before the first) of the backward,
        the weights and the weight gradients' backward, at the microbatch."""
        costs = self._costs(self.options[x])
        backward, made = costs.layer_backward_at(self.fraction, self.inputs.weight_grad_share)
        return tuple(np.concatenate([[0.0], np.cumsum(v)]) for v in (  # type: ignore[return-value]
            backward, np.asarray(costs.layer_weights), made))

    def cut(self, block: int, after: int) -> FloatArray:
        """``[j]``: one microbatch's cut after layer ``j`` from the stage on ``block`` to
        the one on ``after``, each copy of the pipeline on its own links
        (:func:`~dreampipe.planning.sync_links.copy_cut_seconds`; 0 after the last)."""
        if (block, after) not in self._cuts:
            sizes, at = self._cut_sizes
            priced = copy_cut_seconds(sizes * self.fraction, self.workers(block),
                                      self.workers(after), self.t, self.inputs.topology)
            self._cuts[block, after] = np.append(priced[at], 0.0)
        return self._cuts[block, after]

    @functools.cached_property
    def _cut_sizes(self) -> tuple[FloatArray, IntArray]:
        """The profile's distinct cut sizes, and each cut's (a profile by shape repeats its
        cuts, so each size is priced once)."""
        sizes, at = np.unique(self.inputs.costs.cut_bytes[1:], return_inverse=True)
        return sizes, at

    def work(self, x: int, first: int, last: int) -> tuple[float, float]:
        """``(forward, compute)`` of a stage ``first..last`` run as option ``x``, at the
        microbatch, as its ``tau`` counts them before its ZeRO level's collectives (which
        the simulator adds, :mod:`~dreampipe.planning.zero_terms`): its forward, and its
        forward and backward with what it recomputes (a split stage's collectives'
        latencies unscaled)."""
        rows, end = np.array([first]), np.array([last])
        compute, forward = self._at_fraction(x, rows, end)
        again = self._again(x, rows, end, forward)
        whole = float(compute[0] + again[0])  # separate sums: forward may round above it
        return min(float(forward[0]), whole), whole

    def allreduce(self, x: int, block: int, first: int, last: int) -> float:
        """One all-reduce of the weights of a stage ``first..last`` run as option ``x`` over
        its replicas on ``block`` (0 on one replica)."""
        weights = float(self._costs(self.options[x]).weights[first, last])
        if self.d < 2 or weights <= 0:
            return 0.0
        lat, per = replica_allreduce_terms(self.groups(block), self.t, self.inputs.topology,
                                           self.inputs.sync, self.d)
        return lat + per * weights

    def recomputed(self, x: int, first: int, last: int) -> tuple[int, ...]:
        """The layers of a stage ``first..last`` run as option ``x`` that recompute block by
        block (none for the other options)."""
        o = self.options[x]
        if o.recompute is not Recompute.BLOCKS:
            return ()
        row = block_mask(self.inputs.blocks, o.blocks)[first]
        return tuple(int(i) for i in range(first, last + 1) if row[i])

    # ---- memory (:class:`~dreampipe.planning.sync_memory.StageMemory`) -----------
    def memory(self, x: int, held: float) -> FloatArray:
        """``[i, j]``: bytes per worker of option ``x`` holding ``held`` microbatches."""
        return self._memory.memory(x, held)

    def memory_at(self, x: int, held: float, first: int, last: int) -> float:
        """:meth:`memory` of the one stage ``first..last``."""
        return self._memory.memory_at(x, held, first, last)

    def capacity(self, x: int, room: float, width: int | None = None) -> FloatArray:
        """The most microbatches option ``x`` holds within ``room`` bytes per worker, over
        the stages of :meth:`times` (:meth:`StageMemory.capacity`)."""
        return self._memory.capacity(x, room, width)

    def edge_capacity(self, x: int, room: float, width: int, last_slot: bool) -> FloatArray:
        """:meth:`capacity` of the stages of :meth:`edge_times`."""
        return self._memory.edge_capacity(x, room, width, last_slot)

    def fits(self, x: int, held: int, room: float, first: int, last: int) -> bool:
        """Whether a stage ``first..last`` run as option ``x`` fits ``room`` holding
        ``held`` microbatches (:meth:`capacity`, for one stage)."""
        return self._memory.fits(x, held, room, first, last)

    # ---- helpers -----------------------------------------------------------------
    def _costs(self, o: StageOption) -> RangeCosts:
        return self.inputs.costs if o.split is None else o.split.costs

    def _again(self, x: int, rows: IntArray, last: IntArray, forward: FloatArray
               ) -> FloatArray:
        """The forward that option ``x``'s stages ``rows..last`` run again in their
        backward, given their ``forward`` at the microbatch."""
        o = self.options[x]
        if o.recompute is Recompute.NONE:
            return np.zeros_like(forward)
        if o.recompute is Recompute.STAGE:
            return np.asarray(np.where(np.isfinite(forward), forward, 0.0))
        # the recomputed blocks are one run of layers from the stage's first block on:
        # their range's forward, its collectives between them included
        start, stop = block_span(self.inputs.blocks, o.blocks)
        first, end = start[rows], np.minimum(last, stop[rows])
        safe = np.minimum(first, self.n - 1)
        again = self._at_fraction(x, safe, np.maximum(end, safe))[1]
        return np.asarray(np.where(end >= first, again, 0.0))

    def _at_fraction(self, x: int, rows: IntArray, last: IntArray
                     ) -> tuple[FloatArray, FloatArray]:
        """``(compute, forward)`` of option ``x``'s stages ``rows..last`` at the microbatch:
        scaled by its fraction with the profile's fixed part
        (:meth:`~dreampipe.planning.costs.RangeCosts.at_fraction`), or a split stage's own
        (its collectives' latency once a microbatch); indexed before scaled, so no square
        table is made."""
        o, f = self.options[x], self.fraction
        if o.split is None:
            return self._costs(o).at_fraction(f, rows, last, read=pick)
        return o.split.at_fraction(f, rows, last)


_Common = tuple[FloatArray, FloatArray, FloatArray, FloatArray, FloatArray]
_Times = tuple[FloatArray, FloatArray, FloatArray]


def _joined(first: _Times, then: _Times, axis: int = 1) -> _Times:
    """Times of stages ``first`` and ``then`` side by side along ``axis`` (a band's
    columns, an edge's columns or rows)."""
    return (np.concatenate((first[0], then[0]), axis=axis),
            np.concatenate((first[1], then[1]), axis=axis),
            np.concatenate((first[2], then[2]), axis=axis))


def block_groups(block: int, d: int, t: int, topology: Topology) -> tuple[int, ...]:
    """How the ``d`` replicas of ``t`` workers of the stage on worker block ``block`` sit
    in ``topology`` (:func:`~dreampipe.planning.sync.replica_groups` of their first
    workers, block ``k`` holding workers ``k d t .. (k + 1) d t - 1``)."""
    size = d * t
    return replica_groups(tuple(range(block * size, (block + 1) * size, t)), topology)

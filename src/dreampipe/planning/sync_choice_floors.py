"""The floors of a synchronous search's choices: times no plan of a choice beats.

A choice (:class:`Choice`: ``t``, ``d``, ``b``, the schedule, ``v`` and ``p``) that
cannot hold the weights' state is not made (:meth:`ChoiceFloors.fewest_stages`); every
other is priced from below by its compute (:meth:`ChoiceFloors.floor`), then by its cuts
and what memory forces (:meth:`ChoiceFloors.floor_with_cuts`), from the terms of
:mod:`dreampipe.planning.sync_floors` (docs/planner.md, "The synchronous objective").
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import numpy as np

from dreampipe.planning.costs import FloatArray
from dreampipe.planning.sync_floors import (
    OptionFloors,
    Reach,
    band_width,
    envelope,
    layer_floors,
    least_largest,
    least_largest_with_cut,
    least_layers,
    least_stage_sum,
    least_sum,
    option_floors,
    scaled_computes,
)
from dreampipe.planning.sync_inputs import SearchInputs
from dreampipe.planning.sync_links import replica_allreduce_terms
from dreampipe.planning.sync_objective import PipelineKind, factor, slots
from dreampipe.planning.sync_stage_option import Recompute
from dreampipe.planning.sync_tables import block_groups
from dreampipe.planning.triangle import upper
from dreampipe.planning.zero_terms import SHARDED_LEVEL

__all__ = ["Choice", "ChoiceFloors"]


class Choice(NamedTuple):
    """One choice made outside the program, ordered by its floor."""

    floor: float
    t: int
    d: int
    b: int
    kind: PipelineKind
    v: int
    p: int


class ChoiceFloors(SearchInputs):
    """A search's floors, each made once (module doc)."""

    @functools.cache  # noqa: B019 - one search, dropped with it
    def least_compute(self, t: int) -> float:
        """A floor on the sum of a pipeline's ``tau`` for a profiled minibatch, over the
        options on ``t`` workers a replica
        (:func:`~dreampipe.planning.sync_floors.least_layers`)."""
        return least_layers(self.inputs.costs, {o.split for o in self.options(t)})

    @functools.cache  # noqa: B019 - one search, dropped with it
    def zb_ratio(self, t: int) -> float:
        """ZB-H1's floor ``rho`` on ``t`` workers a replica (:func:`~dreampipe.planning.
        sync_objective.factor`): ``1 - 2 s``, ``s`` the largest share of a layer's compute
        that its weight gradient is, over the options. A stage's compute at any microbatch
        sums at least its layers' floors (:func:`~dreampipe.planning.sync_floors.
        layer_floors`, latencies left out) and its weight gradient their weight
        gradients, so its share is at most its layers' largest, of their proportional
        and of their fixed parts (a microbatch's time mixes the two); its ``tau + cut``
        only adds to its compute."""
        share = np.asarray(self.inputs.weight_grad_share)
        most = 0.0
        for split in {o.split for o in self.options(t)}:
            costs = self.inputs.costs if split is None else split.costs
            compute = layer_floors(self.inputs.costs, split)[0]
            pairs = [(np.asarray(costs.layer_backward_s) * share, compute)]
            if costs.layer_fixed_weight_s is not None and costs.fixed_s is not None:
                # a microbatch's part is a mix of the proportional and the fixed parts
                pairs.append((costs.layer_fixed_weight_s, np.diag(costs.fixed_s)))
            for made, whole in pairs:
                ok = np.isfinite(whole) & (whole > 0)
                if np.any(made[~ok] > 0):
                    return 0.0
                if ok.any():
                    most = max(most, float(np.max(made[ok] / whole[ok])))
        return max(0.0, 1.0 - 2.0 * most)

    @functools.cache  # noqa: B019 - one search, dropped with it
    def least_weights(self, t: int) -> float:
        """A floor on the weight bytes a pipeline's stages hold together on a replica of
        ``t`` workers: each layer's least over the options (stages' weights are sums of
        their layers')."""
        return least_sum(self.inputs.costs, {o.split for o in self.options(t)},
                         lambda c: c.weights)

    @functools.cache  # noqa: B019 - one search, dropped with it
    def envelope(self, t: int) -> FloatArray:
        """:func:`~dreampipe.planning.sync_floors.envelope` of the options on ``t``
        workers a replica, for a profiled minibatch."""
        return envelope(scaled_computes(self.inputs.costs, {o.split for o in self.options(t)}))

    @functools.cache  # noqa: B019 - one search, dropped with it
    def least_stage(self, t: int, count: int) -> float:
        """A floor on the largest ``tau`` of ``count`` stages, for a profiled minibatch."""
        return least_largest(self.reach(t), count, self.least_compute(t) / count)

    @functools.cache  # noqa: B019 - one search, dropped with it
    def reach(self, t: int) -> Reach:
        """:meth:`envelope`'s stages' reach, for :meth:`least_stage`."""
        return Reach(self.envelope(t))

    def width(self, t: int, theta: float) -> int:
        """The most layers a stage of ``t`` workers a replica may hold while its floor
        (:meth:`envelope`, per profiled minibatch) stays below ``theta``."""
        return band_width(self.envelope(t), theta)

    def fewest_stages(self, t: int, d: int, b: int) -> int:
        """The fewest stages whose workers can hold the weights' state and one
        microbatch of ``b`` samples: each stage (each chunk within ``1 / v`` of a worker)
        holds its weights' state (:meth:`least_weights`) and, unless it recomputes block
        by block, what its layers keep for a microbatch at least once (a recomputing
        stage holds it while it recomputes), so ``p`` workers hold at least the model's."""
        limit = self.opts.memory_bytes
        if limit is None:
            return 1
        state = self.least_weights(t) * min(self._state(z, d) for z in self.zero_levels(d))
        return max(1, math.ceil((state + self.least_kept(t) * b / self.base) / limit - 1e-9))

    @functools.cache  # noqa: B019 - one search, dropped with it
    def least_kept(self, t: int) -> float:
        """A floor on the bytes a pipeline's stages keep together for a profiled minibatch
        on a replica of ``t`` workers: each layer's least over the options, none where a
        stage may recompute block by block (it keeps one block's)."""
        if self._by_blocks(t):
            return 0.0
        return least_sum(self.inputs.costs, {o.split for o in self.options(t)},
                         lambda c: c.kept)

    def _by_blocks(self, t: int) -> bool:
        """Whether a stage on ``t`` workers a replica may recompute block by block."""
        return any(o.recompute is Recompute.BLOCKS for o in self.options(t))

    def _state(self, level: int, d: int) -> float:
        """Bytes of state a byte of weights keeps at ZeRO ``level`` over ``d`` replicas."""
        return self.opts.training.state_per_byte(self.inputs.profiled_param_bytes, level, d)

    def floor(self, c: Choice) -> float:
        """A floor on the update time of choice ``c`` (the update takes at least its
        pipeline term): ``phi`` times the largest stage's :meth:`least_stage` at the
        microbatch."""
        m = self.opts.global_batch // (c.d * c.b)
        phi = factor(c.kind, c.p, m, c.v, self.zb_ratio(c.t))
        return max(c.floor, phi * self.least_stage(c.t, c.p * c.v) * c.b / self.base)

    @functools.cache  # noqa: B019 - one search, dropped with it
    def least_taus(self, t: int, d: int, b: int, held: int, p: int, count: int) -> float:
        """A floor on the sum of the ``tau`` of a pipeline's ``count`` stages on ``p``
        workers, ``d`` replicas of ``t`` workers, microbatches of ``b``, each stage holding
        ``held`` or more, within the memory limit
        (:func:`~dreampipe.planning.sync_floors.least_stage_sum`): less the least each
        stage holds besides its layers' (:attr:`least_besides`) and every stage's but the
        first's inputs; level-3 gathers at the cheapest rate of the ``p`` worker blocks."""
        limit, levels = self.opts.memory_bytes, self.zero_levels(d)
        f = b / self.base
        if limit is None:
            return self.least_compute(t) * f
        besides, entry = self.least_besides
        if self._by_blocks(t):
            entry = 0.0  # its floor counts a block's input at the block, a stage's first too
        room = p * limit - count * besides * f - (count - 1) * held * entry * f
        per = 0.0 if SHARDED_LEVEL not in levels else self._cheapest_rate(t, d, p)
        return least_stage_sum(self.option_floors(t), {z: self._state(z, d) for z in levels},
                               per, f, held, room)

    @functools.cache  # noqa: B019 - one search, dropped with it
    def _cheapest_rate(self, t: int, d: int, p: int) -> float:
        """The least seconds a byte of the ``p`` worker blocks' all-reduces over ``d``
        replicas of ``t`` workers, made once for every microbatch and count of stages."""
        return min(replica_allreduce_terms(block_groups(k, d, t, self.topology), t,
                                           self.topology, self.opts.sync, d)[1]
                   for k in range(p))

    @functools.cache  # noqa: B019 - one search, dropped with it
    def option_floors(self, t: int) -> tuple[OptionFloors, ...]:
        """Each option's floors on ``t`` workers a replica, layer by layer
        (:func:`~dreampipe.planning.sync_floors.option_floors`)."""
        return tuple(option_floors(self.inputs.costs, o, self.inputs.blocks)
                     for o in self.options(t))

    @functools.cached_property
    def least_besides(self) -> tuple[float, float]:
        """The least a stage holds besides its weights' state and its microbatches' tensors
        (its backward's working set and its sends), and the least input of a stage after
        the first, for a profiled minibatch: every option's are the profile's."""
        costs = self.inputs.costs
        entry = float(np.min(costs.cut_bytes[1:])) if costs.n > 1 else 0.0
        return float(np.min(costs.held_besides[upper(costs.n)])), entry

    def floor_with_cuts(self, c: Choice, floor: float) -> float:
        """:meth:`floor` (given as ``floor``) raised by the cuts: every stage but the last
        adds its cut, at least the least cut between its worker blocks, to its ``tau``;
        :func:`~dreampipe.planning.sync_floors.least_largest_with_cut` at the
        microbatch; and by the memory: ``phi`` times the mean stage's :meth:`least_taus`
        and cut."""
        m = self.opts.global_batch // (c.d * c.b)
        sl = slots(c.kind, c.p, m, c.v, self.zb_ratio(c.t))
        taus = self.least_taus(c.t, c.d, c.b, min(sl.in_flight), c.p, sl.count)
        if sl.count < 2:
            return max(floor, sl.least * taus)
        tables = self.tables(c.t, c.d, c.b, c.kind is PipelineKind.ZB_H1)
        cut = min(float(np.min(tables.cut(a, b)[:-1]))
                  for a, b in set(itertools.pairwise(sl.blocks)))
        floor = max(floor, sl.least * (taus + (sl.count - 1) * cut) / sl.count)
        lo = least_largest_with_cut(self.reach(c.t), c.b / self.base, cut, sl.count,
                                    floor / sl.least)
        return max(floor, sl.least * lo)

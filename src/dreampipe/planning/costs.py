"""The planner's cost model: small named terms, each vectorised with NumPy.

Every term is per minibatch, in seconds or bytes (docs/design.md §3). A stage
of layers ``i..j`` on ``r`` replicas takes ``max(C, F + end) / r``, its
all-reduce going out bucket by bucket during the backward
(:mod:`dreampipe.planning.sync` prices the algorithm); a cut costs
``2 (alpha + a_k / B) / copies``. Transfers and all-reduces overlap compute,
so a pipeline's time is the *max* of its terms, never their sum. ``Input``
nodes cost nothing. What a worker holds is priced by
:mod:`dreampipe.planning.memory_terms`. :class:`RangeCosts` holds the
profile's sums over every layer range, the inputs of these terms for any
candidate stage.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from dreampipe.planning.held import held_table, range_max
from dreampipe.planning.memory_terms import (
    SENDS_KEPT,
    STATELESS,
    OptimizerTerms,
    input_copies,
    max_versions,
    memory_bytes,
)
from dreampipe.planning.triangle import upper
from dreampipe.profiling.fixed_costs import fixed_parts, fixed_share
from dreampipe.profiling.graph import LayerGraph

__all__ = ["GPIPE_MICROBATCHES_PER_STAGE", "BoolArray", "CostModel", "FloatArray", "RangeCosts",
           "allreduce_end", "allreduce_ends", "cut_time", "gpipe_time", "stage_time"]

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]
#: Every range of a table, as an index.
_ALL = slice(None)
#: Reads ``table[rows, last]`` (:meth:`RangeCosts.at_fraction`).
_Read = Callable[[FloatArray, Any, Any], FloatArray]


def _index(table: FloatArray, rows: Any, last: Any) -> FloatArray:
    return np.asarray(table[rows, last])


class CostModel(StrEnum):
    """Which cost terms the planner's DP uses; both run through the same DP.

    ``DREAMPIPE`` (default): the terms of this module, one all-reduce per
    round overlapped with the backward, links priced where they are crossed.
    ``PIPEDREAM``: PipeDream's own optimizer,
    term for term (:mod:`dreampipe.planning.pipedream_costs`), to reproduce
    its published figures.
    """

    DREAMPIPE = "dreampipe"
    PIPEDREAM = "pipedream"

#: GPipe's own guidance (Huang et al., 2019): the bubble is negligible with at
#: least four microbatches per stage, so the GPipe baseline uses ``4 * stages``.
GPIPE_MICROBATCHES_PER_STAGE = 4

def stage_time(
    compute_s: FloatArray | float, forward_s: FloatArray | float,
    allreduce_end_s: FloatArray | float, replicas: int,
) -> FloatArray:
    """``max(C, F + end) / r``: one stage replicated ``r`` ways, per minibatch.

    Each replica runs one minibatch of the round (forward ``F``, then the
    backward ``C - F``); the round's all-reduce ends ``end`` after that
    backward starts (:func:`allreduce_end`), so it overlaps the backward
    only; ``r`` replicas share the minibatches, hence the division.
    """
    c = np.asarray(compute_s, dtype=np.float64)
    late = np.asarray(forward_s, dtype=np.float64) + np.asarray(allreduce_end_s, dtype=np.float64)
    return np.asarray(np.maximum(c, late) / replicas)


def allreduce_end(
    backward_s: FloatArray | Sequence[float], weight_bytes: FloatArray | Sequence[float],
    latency: float, per_byte: float, *, overlap: bool = True,
) -> FloatArray:
    """Seconds from a stage's backward start to its all-reduce's end, for every layer range.

    ``backward_s[l]`` and ``weight_bytes[l]`` are layer ``l``'s; entry ``[i, j]``
    is the stage of layers ``i..j`` (0 where it has no weights). The backward
    runs the layers last to first, and layer ``k``'s gradient is final once
    the backward of ``k..j`` is done; buckets go out in that order on one
    link, so what is left to send then is the weights of ``i..k``. A queue
    served in order ends at the latest of those::

        end(i..j) = latency + max over k in i..j with |w_k| > 0 of
                              ( B_k..j + per_byte * |w|_i..k )

        backward     | layer j | layer j-1 | ... | layer i |
        all-reduce             | w_j | w_j-1 .............. w_i |  <- end

    It is the whole all-reduce after the last weighted layer's backward at
    the least, and ``B_i..j`` plus the last bucket at the most. Without
    ``overlap`` (communication on the computing cores, see
    :class:`~dreampipe.planning.topology.Topology`) it is the whole backward
    and then the whole all-reduce: ``B_i..j + latency + per_byte * |w|_i..j``.
    """
    ends = allreduce_ends(backward_s, weight_bytes, np.array([latency]), np.array([per_byte]),
                          overlap=overlap)
    return np.asarray(ends[0])


def allreduce_ends(
    backward_s: FloatArray | Sequence[float], weight_bytes: FloatArray | Sequence[float],
    latency: FloatArray, per_byte: FloatArray, *, overlap: bool = True,
) -> FloatArray:
    """:func:`allreduce_end` for many all-reduces at once: entry ``[p, i, j]`` has the terms
    ``latency[p]``, ``per_byte[p]``; one NumPy pass instead of a call per layout
    (the planner prices every layout of a level's contexts), the same value bit for bit.
    """
    b = np.asarray(backward_s, dtype=np.float64)
    w = np.asarray(weight_bytes, dtype=np.float64)
    lat = np.asarray(latency, dtype=np.float64)[:, None, None]
    per = np.asarray(per_byte, dtype=np.float64)[:, None, None]
    pb = np.concatenate([[0.0], np.cumsum(b)])
    pw = np.concatenate([[0.0], np.cumsum(w)])
    n = len(b)
    later = upper(n)
    if overlap:  # in place on one [p, i, j] array: the planner passes thousands of layouts
        h = np.where(w > 0, per * pw[1:] - pb[:-1], -np.inf)  # [p, 1, k]
        end = np.where(later, h, -np.inf)
        np.maximum.accumulate(end, axis=2, out=end)
        end += lat + pb[None, None, 1:] - per * pw[None, :-1, None]
    else:
        end = (lat + (pb[None, 1:] - pb[:-1, None])
               + per * (pw[None, None, 1:] - pw[None, :-1, None]))
    weighted = (pw[None, 1:] - pw[:-1, None]) > 0
    np.copyto(end, 0.0, where=~(later & weighted))
    return np.asarray(end)


def cut_time(
    activation_bytes: FloatArray | float, bandwidth: float, latency: float = 0.0
) -> FloatArray:
    """``2 (alpha + a/B)``: activations forward and their gradients back across a cut.

    Transfers overlap compute on both sides, so the cut is one more term in
    the pipeline's max, not an addition to a stage.
    """
    a = np.asarray(activation_bytes, dtype=np.float64)
    return np.asarray(2.0 * (latency + a / bandwidth))


def gpipe_time(slowest_stage_s: float, num_stages: int, microbatches: int | None = None) -> float:
    """GPipe's time per minibatch: ``(M + p - 1) / M`` times the slowest stage.

    A minibatch split into ``M`` microbatches fills and drains a ``p``-stage
    pipeline once per update (the bubble), then flushes::

        stage 0 |F1 F2 F3 F4|         |B4 B3 B2 B1|
        stage 1 |   F1 F2 F3 F4|   |B4 B3 B2 B1|

    ``M`` defaults to ``GPIPE_MICROBATCHES_PER_STAGE * p``.
    """
    m = microbatches if microbatches is not None else GPIPE_MICROBATCHES_PER_STAGE * num_stages
    return (m + num_stages - 1) / m * slowest_stage_s


@dataclass(frozen=True)
class RangeCosts:
    """Range sums of a profile: entry ``[i, j]`` covers layers ``i..j`` (seconds, bytes).

    ``compute_s`` is ``inf`` where ``i > j`` so that empty ranges never win a min;
    ``forward_s`` is the forward part of it (None: not split, taken as 0);
    ``cut_bytes[k]`` is what crosses the cut before layer ``k`` (DAG rule);
    ``stage_ok[s, e]``, when given, says whether a stage after a cut may span
    ``s..e`` (PipeDream's cut rule over its states; None: any range).
    ``layer_backward_s`` and ``layer_weights`` are each layer's own, for
    :meth:`allreduce_end` (the default model; None under PipeDream's).
    ``stashed`` sums what a microbatch in flight keeps of each layer
    (:attr:`~dreampipe.profiling.graph.Layer.stash_bytes`; None: ``activations``)
    and ``working`` what the range holds besides (:mod:`.held`: the largest layer's
    backward working set and the library's kernel memory; None: 0). ``optimizer``
    is what the optimizer holds beside the weights (:class:`OptimizerTerms`: its state
    and its step's temporaries), which every memory term of the range counts.
    ``copied[k]`` is what a stage that begins at layer ``k`` keeps per microbatch beside
    its input where layer ``k`` writes that input in place (:func:`.input_copies`; None: 0).
    ``fixed_s``, ``fixed_forward_s`` and ``layer_fixed_backward_s`` are the parts of
    ``compute_s``, ``forward_s`` and ``layer_backward_s`` a call pays whatever its batch,
    and ``layer_fixed_weight_s`` that of each layer's weight gradient, where the profile
    was timed at a small batch too (None: none; :meth:`at_fraction`).
    """

    compute_s: FloatArray
    weights: FloatArray
    activations: FloatArray
    cut_bytes: FloatArray
    stage_ok: BoolArray | None = None
    forward_s: FloatArray | None = None
    layer_backward_s: FloatArray | None = None
    layer_weights: FloatArray | None = None
    stashed: FloatArray | None = None
    working: FloatArray | None = None
    optimizer: OptimizerTerms = STATELESS
    fixed_s: FloatArray | None = None
    fixed_forward_s: FloatArray | None = None
    layer_fixed_backward_s: FloatArray | None = None
    layer_fixed_weight_s: FloatArray | None = None
    copied: FloatArray | None = None

    @classmethod
    def of(cls, graph: LayerGraph, optimizer: OptimizerTerms = STATELESS) -> RangeCosts:
        """The sums of ``graph``, ``Input`` nodes' times zeroed (docs/design.md §2), under
        ``optimizer``'s terms."""
        def sums(values: Sequence[float], empty: float) -> FloatArray:
            prefix = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])
            table = prefix[None, 1:] - prefix[:-1, None]
            n = len(values)
            return np.where(upper(n), table, empty)

        layers = graph.layers
        work = [0.0 if x.is_input else 1e-3 for x in layers]
        weights = [x.parameter_bytes for x in layers]
        parts = fixed_parts(graph)
        fixed = None if parts is None else np.asarray(parts, dtype=np.float64) * np.asarray(
            work)[:, None]  # [layer, (forward, backward, weight gradient)], in seconds
        return cls(
            sums([x.compute_ms * k for x, k in zip(layers, work, strict=True)], np.inf),
            # a stage holds its own weights and a copy of those it shares with earlier ones
            sums(weights, 0.0) + (graph.reused_table() if any(x.reused for x in layers)
                                  else 0.0),
            sums([x.activation_bytes for x in layers], 0.0),
            np.asarray(graph.cut_bytes(), dtype=np.float64),
            forward_s=sums([x.forward_ms * k for x, k in zip(layers, work, strict=True)], 0.0),
            layer_backward_s=np.asarray(
                [x.backward_ms * k for x, k in zip(layers, work, strict=True)], dtype=np.float64),
            layer_weights=np.asarray(weights, dtype=np.float64),
            stashed=sums([x.stash_bytes for x in layers], 0.0),
            working=held_table(graph),
            optimizer=optimizer,
            fixed_s=None if fixed is None else sums(list(fixed[:, 0] + fixed[:, 1]), 0.0),
            fixed_forward_s=None if fixed is None else sums(list(fixed[:, 0]), 0.0),
            layer_fixed_backward_s=None if fixed is None else fixed[:, 1],
            layer_fixed_weight_s=None if fixed is None else fixed[:, 2],
            copied=np.asarray(input_copies(graph), dtype=np.float64),
        )

    def at_fraction(self, fraction: float, rows: IntArray | slice = _ALL,
                    last: IntArray | slice = _ALL, read: _Read | None = None
                    ) -> tuple[FloatArray, FloatArray]:
        """``(compute, forward)`` of the ranges ``rows..last`` (index arrays of one shape;
        every range by default; ``read(table, rows, last)`` reads them, NumPy's indexing
        by default) for a microbatch ``fraction`` of the profiled batch: in proportion,
        plus the fixed part the profile's small batch measured at batches below the
        profiled one (:func:`~dreampipe.profiling.fixed_costs.at_fraction`)."""
        at = read or _index
        compute = at(self.compute_s, rows, last) * fraction
        forward = at(self.forward, rows, last) * fraction
        keep = fixed_share(fraction)
        if self.fixed_s is None or keep == 0:
            return compute, forward
        assert self.fixed_forward_s is not None
        return (compute + at(self.fixed_s, rows, last) * keep,
                forward + at(self.fixed_forward_s, rows, last) * keep)

    def layer_backward_at(self, fraction: float, weight_share: Sequence[float]
                          ) -> tuple[FloatArray, FloatArray]:
        """Each layer's backward and its weight gradient (``weight_share`` of the profiled
        backward) for a microbatch ``fraction`` of the profiled batch, as
        :meth:`at_fraction` reads times."""
        assert self.layer_backward_s is not None
        backward = np.asarray(self.layer_backward_s) * fraction
        weight = backward * np.asarray(weight_share, dtype=np.float64)
        keep = fixed_share(fraction)
        if self.layer_fixed_backward_s is None or self.layer_fixed_weight_s is None \
                or keep == 0:
            return backward, weight
        return (np.asarray(backward + self.layer_fixed_backward_s * keep),
                np.asarray(weight + self.layer_fixed_weight_s * keep))

    def allreduce_ends(self, latency: FloatArray, per_byte: FloatArray, *, overlap: bool = True
                       ) -> FloatArray:
        """:func:`allreduce_ends` of every range of this profile, ``[terms, i, j]``."""
        assert self.layer_backward_s is not None and self.layer_weights is not None
        return allreduce_ends(self.layer_backward_s, self.layer_weights, latency, per_byte,
                              overlap=overlap)

    @functools.cached_property
    def held_besides(self) -> FloatArray:
        """``[i, j]``: a stage's backward working set and the sends it keeps, made once."""
        return np.asarray(self.backward_working + SENDS_KEPT * self.sent)

    @functools.cached_property
    def step_held(self) -> FloatArray:
        """``[i, j]``: the bound on the optimizer step's temporaries of a stage of layers
        ``i..j`` (:class:`OptimizerTerms`), made once; 0 without an optimizer's terms."""
        opt = self.optimizer
        if opt.per_largest == 0 and opt.per_byte == 0:
            return np.zeros_like(self.weights)
        largest = self.largest_weights if self.layer_weights is not None else self.weights
        return opt.step_bytes(largest, self.weights)

    @functools.cached_property
    def largest_weights(self) -> FloatArray:
        """``[i, j]``: the largest one layer's weights in ``i..j``, made once."""
        assert self.layer_weights is not None
        return range_max(list(np.asarray(self.layer_weights)))

    @property
    def forward(self) -> FloatArray:
        """``forward_s``, or zeros where the profile does not split forward from backward."""
        return self.forward_s if self.forward_s is not None else np.zeros_like(self.weights)

    @property
    def n(self) -> int:
        return int(self.compute_s.shape[0])

    @property
    def kept(self) -> FloatArray:
        """``[i, j]``: what one microbatch in flight keeps of layers ``i..j`` for the backward."""
        return self.stashed if self.stashed is not None else self.activations

    @property
    def copies(self) -> FloatArray:
        """``[k]``: :attr:`copied`, zeros where not given."""
        return self.copied if self.copied is not None else np.zeros(self.n)

    @functools.cached_property
    def stage_kept(self) -> FloatArray:
        """``[i, j]``: what one microbatch in flight keeps of a stage of layers ``i..j`` beside
        its input: its layers' :attr:`kept` tensors and the copy of its input (:attr:`copies`)."""
        return np.asarray(self.kept + np.triu(np.outer(self.copies, np.ones(self.n))))

    @property
    def inputs(self) -> FloatArray:
        """``[i, j]``: one microbatch's input to a stage that starts at layer ``i`` (the cut
        before)."""
        return np.asarray(np.broadcast_to(self.cut_bytes[:, None], (self.n, self.n)))

    @property
    def sent(self) -> FloatArray:
        """``[i, j]``: the larger tensor a stage ``i..j`` sends, its output or its input's
        gradient (the cuts around it)."""
        after = np.append(self.cut_bytes[1:], 0.0)
        return np.asarray(np.maximum(self.cut_bytes[:, None], after[None, :]))

    @property
    def backward_working(self) -> FloatArray:
        """``[i, j]``: what a stage of layers ``i..j`` holds besides its weights and
        microbatches (:mod:`.held`)."""
        return self.working if self.working is not None else np.zeros_like(self.weights)

    def max_versions(self, memory_bytes: float, recompute: bool = False) -> FloatArray:
        """:func:`max_versions` of every layer range in ``memory_bytes``."""
        return max_versions(self.weights, self.stage_kept, memory_bytes, input_bytes=self.inputs,
                            sent_bytes=self.sent, working_bytes=self.backward_working,
                            recompute=recompute, optimizer_copies=self.optimizer.state_copies,
                            step_bytes=self.step_held)

    def memory(self, first: int, last: int, versions: int, in_flight: int | None = None, *,
               optimizer_copies: float | None = None, stash: bool = True,
               sends_kept: int = SENDS_KEPT, recompute: bool = False) -> int:
        """:func:`memory_bytes` of a stage of layers ``first..last`` (in flight: ``versions``;
        optimizer state: ``optimizer_copies``, None for the range's own; with its step's
        temporaries, the range's own: none for a profile's plain ranges)."""
        after = float(self.cut_bytes[last + 1]) if last + 1 < self.n else 0.0
        return round(float(memory_bytes(
            self.weights[first, last], self.stage_kept[first, last], versions,
            versions if in_flight is None else in_flight,
            input_bytes=self.cut_bytes[first],
            sent_bytes=max(float(self.cut_bytes[first]), after),  # one entry of sent
            working_bytes=self.backward_working[first, last],
            optimizer_copies=(self.optimizer.state_copies if optimizer_copies is None
                              else optimizer_copies),
            step_bytes=float(self.step_held[first, last]),
            stash=stash, sends_kept=sends_kept, recompute=recompute,
        )))

    def memories(self, spans: Sequence[tuple[int, int]], in_flight: Sequence[int],
                 recompute: Sequence[bool] = ()) -> list[int]:
        """Bytes per worker of each stage ``(first, last)`` of one pipeline, holding
        ``in_flight`` minibatches (:mod:`dreampipe.planning.in_flight`); ``recompute`` says
        which stages recompute (empty: none)."""
        flags = recompute or [False] * len(spans)
        return [self.memory(first, last, v, recompute=rc)
                for (first, last), v, rc in zip(spans, in_flight, flags, strict=True)]

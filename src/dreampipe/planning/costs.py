"""The planner's cost model: small named terms, each vectorised with NumPy.

Every term is per minibatch and in seconds or bytes. A replicated stage's
``r`` replicas run ``r`` minibatches per round, then all-reduce their
gradients once (:mod:`dreampipe.planning.sync` prices the algorithm). The
all-reduce goes out during the backward, bucket by bucket as DDP does, as
each layer's gradient becomes final (last layer first), so it hides behind
the backward of the layers below the first one with weights, never behind
the forward. Transfers across a cut run on their own links and overlap
compute, so a pipeline's time is the *max* of its terms, never their sum::

    stage i..j on r replicas:   T = max(C, F + end) / r           (C = F + backward)
    all-reduce end:             end = alpha + max over k of (B_k..j + |w|_i..k / B')
    cut before layer k:         2 (alpha + a_k / B) / copies      (activations out, gradients back)
    pipeline:                   A = max over stages and cuts

``Input`` nodes of a PipeDream profile are zeroed: their time is data
loading, which overlaps training (PipeDream's optimizer zeroes them too).

Memory per worker follows DESIGN §5: a stage keeps one weight version and one
minibatch of stashed activations per minibatch it has in flight, plus one
gradient buffer::

    versions = ceil(workers from this stage to the end / replicas of this stage)
    memory   = weights * (versions + 1) + activations * in flight

(in the steady state the versions equal the minibatches in flight). The
simulator (:mod:`dreampipe.simulation`) and the schedule builder take these
same terms.

:class:`RangeCosts` holds the profile's sums over every layer range, the
inputs of these terms for any candidate stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from dreampipe.profiling.graph import LayerGraph

__all__ = [
    "GPIPE_MICROBATCHES_PER_STAGE",
    "BoolArray",
    "CostModel",
    "FloatArray",
    "RangeCosts",
    "allreduce_end",
    "allreduce_ends",
    "cut_time",
    "gpipe_time",
    "max_versions",
    "memory_bytes",
    "stage_memory",
    "stage_time",
    "versions_in_flight",
]

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


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
    later = np.triu(np.ones((n, n), dtype=bool))
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


def versions_in_flight(workers_to_end: int, replicas: int) -> int:
    """Minibatches (and weight versions) a stage holds: ``ceil(F / r)``.

    PipeDream's 1F1B admits ``NOAM = ceil(workers / replicas_of_input)``
    minibatches; the same count from a stage's own position gives ``n - s``
    for stage ``s`` of a straight ``n``-stage pipeline (DESIGN §5).
    """
    return -(-workers_to_end // replicas)


def memory_bytes(
    weight_bytes: FloatArray | float,
    activation_bytes: FloatArray | float,
    versions: int,
    in_flight: int,
) -> FloatArray:
    """Bytes per worker: ``weights * (versions + 1) + activations * in_flight``.

    Weight stashing keeps ``versions`` weight versions (the live one among
    them) and one unit of stashed activations per unit in flight; the extra
    ``weights`` is the gradient buffer.
    """
    w = np.asarray(weight_bytes, dtype=np.float64)
    a = np.asarray(activation_bytes, dtype=np.float64)
    return np.asarray((versions + 1) * w + in_flight * a)


def stage_memory(
    weight_bytes: FloatArray | float, activation_bytes: FloatArray | float, versions: int
) -> FloatArray:
    """Bytes per worker in the steady state, one version per minibatch in flight.

    :func:`memory_bytes` with ``in_flight = versions``:
    ``versions * (weights + activations) + weights``.
    """
    return memory_bytes(weight_bytes, activation_bytes, versions, versions)


def max_versions(
    weight_bytes: FloatArray | float, activation_bytes: FloatArray | float, memory_bytes: float
) -> FloatArray:
    """The most versions a stage can hold in ``memory_bytes`` (inverse of :func:`stage_memory`).

    0 or less means the stage does not fit at all; a stage of neither
    weights nor activations can hold any number (``inf``).
    """
    w = np.asarray(weight_bytes, dtype=np.float64)
    per = w + np.asarray(activation_bytes, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.floor((memory_bytes - w) / per)
    return np.asarray(np.where(per > 0, k, np.inf))


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
    """

    compute_s: FloatArray
    weights: FloatArray
    activations: FloatArray
    cut_bytes: FloatArray
    stage_ok: BoolArray | None = None
    forward_s: FloatArray | None = None
    layer_backward_s: FloatArray | None = None
    layer_weights: FloatArray | None = None

    @classmethod
    def of(cls, graph: LayerGraph) -> RangeCosts:
        """The sums of ``graph``, ``Input`` nodes' times zeroed (module doc)."""
        def sums(values: Sequence[float], empty: float) -> FloatArray:
            prefix = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])
            table = prefix[None, 1:] - prefix[:-1, None]
            n = len(values)
            return np.where(np.triu(np.ones((n, n), dtype=bool)), table, empty)

        layers = graph.layers
        work = [0.0 if x.is_input else 1e-3 for x in layers]
        weights = [x.parameter_bytes for x in layers]
        return cls(
            sums([x.compute_ms * k for x, k in zip(layers, work, strict=True)], np.inf),
            sums(weights, 0.0),
            sums([x.activation_bytes for x in layers], 0.0),
            np.asarray(graph.cut_bytes(), dtype=np.float64),
            forward_s=sums([x.forward_ms * k for x, k in zip(layers, work, strict=True)], 0.0),
            layer_backward_s=np.asarray(
                [x.backward_ms * k for x, k in zip(layers, work, strict=True)], dtype=np.float64),
            layer_weights=np.asarray(weights, dtype=np.float64),
        )

    def allreduce_ends(self, latency: FloatArray, per_byte: FloatArray, *, overlap: bool = True
                       ) -> FloatArray:
        """:func:`allreduce_ends` of every range of this profile, ``[terms, i, j]``."""
        assert self.layer_backward_s is not None and self.layer_weights is not None
        return allreduce_ends(self.layer_backward_s, self.layer_weights, latency, per_byte,
                              overlap=overlap)

    @property
    def forward(self) -> FloatArray:
        """``forward_s``, or zeros where the profile does not split forward from backward."""
        return self.forward_s if self.forward_s is not None else np.zeros_like(self.weights)

    @property
    def n(self) -> int:
        return int(self.compute_s.shape[0])

    def memories(self, spans: Sequence[tuple[int, int, int]]) -> list[int]:
        """Bytes per worker of each stage ``(first, last, replicas)`` of one pipeline."""
        out, to_end = [], sum(r for _, _, r in spans)
        for first, last, r in spans:
            v = versions_in_flight(to_end, r)
            mem = stage_memory(self.weights[first, last], self.activations[first, last], v)
            out.append(round(float(mem)))
            to_end -= r
        return out

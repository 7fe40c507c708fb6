"""The planner's cost model: small named terms, each vectorised with NumPy.

Every term is per minibatch and in seconds or bytes. Compute, the all-reduce
of a replicated stage and the transfers across a cut run on different
engines and overlap, so a stage's steady-state time is the *max* of its
terms, never their sum (PipeDream, §3.1)::

    stage i..j on m replicas:   T = max(compute, allreduce) / m
    cut before layer k:         2 * a_k / B        (activations out, gradients back)
    pipeline:                   A = max over stages and cuts

Memory per worker follows DESIGN §5: a stage keeps one weight version and one
minibatch of stashed activations per minibatch it has in flight, plus one
gradient buffer::

    versions = ceil(workers from this stage to the end / replicas of this stage)
    memory   = weights * (versions + 1) + activations * in flight

(in the steady state the versions equal the minibatches in flight). The
simulator (:mod:`dreampipe.simulation`) and the schedule builder take these
same terms: the ring all-reduce, the memory formula and the in-flight count.

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
    "allreduce_time",
    "cut_time",
    "gpipe_time",
    "max_versions",
    "memory_bytes",
    "replicated_stage_time",
    "ring_allreduce_time",
    "stage_memory",
    "versions_in_flight",
]

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


class CostModel(StrEnum):
    """Which cost terms the planner's DP uses; both run through the same DP.

    ``DREAMPIPE`` (default): the terms of this module, compute and
    communication overlapped (max). ``PIPEDREAM``: PipeDream's own optimizer,
    term for term (:mod:`dreampipe.planning.pipedream_costs`), to reproduce
    its published figures.
    """

    DREAMPIPE = "dreampipe"
    PIPEDREAM = "pipedream"

#: GPipe's own guidance (Huang et al., 2019): the bubble is negligible with at
#: least four microbatches per stage, so the GPipe baseline uses ``4 * stages``.
GPIPE_MICROBATCHES_PER_STAGE = 4


def ring_allreduce_time(
    weight_bytes: FloatArray | float, replicas: int, bandwidth: float, rounds: int = 1
) -> FloatArray:
    """``rounds`` ring all-reduces of ``|w|`` over ``replicas`` workers: ``2(m-1)/m |w|/B`` each.

    Each worker sends and receives ``2(m-1)/m`` of the weights per round
    (reduce-scatter, then all-gather). The factor ``2(m-1) rounds / m`` is
    formed before it scales the weights, so whole multiples of ``m`` rounds
    are exact.
    """
    factor = 2.0 * (replicas - 1) * rounds / replicas
    return np.asarray(factor * np.asarray(weight_bytes, dtype=np.float64) / bandwidth)


def allreduce_time(weight_bytes: FloatArray | float, replicas: int, bandwidth: float) -> FloatArray:
    """Time for ``replicas`` workers to synchronise a stage's weights: ``2(m-1)|w|/B``.

    The paper's term (DESIGN §3): one :func:`ring_allreduce_time` for each of
    the ``m`` minibatches the replicas run in parallel, ``m`` rounds in all.
    It overlaps the backward pass, hence the max in
    :func:`replicated_stage_time`.
    """
    return ring_allreduce_time(weight_bytes, replicas, bandwidth, rounds=replicas)


def replicated_stage_time(
    inner_s: FloatArray | float, weight_bytes: FloatArray | float, replicas: int, bandwidth: float
) -> FloatArray:
    """``T = max(inner, allreduce) / m``: one stage replicated ``m`` ways.

    ``inner_s`` is the stage's time on one unit (the sum of its layers'
    forward+backward times, or one level down the hierarchy the best
    pipeline inside a server). Compute and all-reduce overlap, hence max;
    ``m`` replicas take minibatches round-robin, hence the division.
    """
    inner = np.asarray(inner_s, dtype=np.float64)
    sync = allreduce_time(weight_bytes, replicas, bandwidth)
    return np.asarray(np.maximum(inner, sync) / replicas)


def cut_time(activation_bytes: FloatArray | float, bandwidth: float) -> FloatArray:
    """``2a/B``: activations forward and their gradients back across a cut.

    Transfers overlap compute on both sides, so the cut is one more term in
    the pipeline's max, not an addition to a stage.
    """
    return np.asarray(2.0 * np.asarray(activation_bytes, dtype=np.float64) / bandwidth)


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
    ``cut_bytes[k]`` is what crosses the cut before layer ``k`` (DAG rule);
    ``stage_ok[s, e]``, when given, says whether a stage after a cut may span
    ``s..e`` (PipeDream's cut rule over its states; None: any range).
    """

    compute_s: FloatArray
    weights: FloatArray
    activations: FloatArray
    cut_bytes: FloatArray
    stage_ok: BoolArray | None = None

    @classmethod
    def of(cls, graph: LayerGraph) -> RangeCosts:
        def sums(values: Sequence[float], empty: float) -> FloatArray:
            prefix = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])
            table = prefix[None, 1:] - prefix[:-1, None]
            n = len(values)
            return np.where(np.triu(np.ones((n, n), dtype=bool)), table, empty)

        layers = graph.layers
        return cls(
            sums([x.compute_ms / 1e3 for x in layers], np.inf),
            sums([x.parameter_bytes for x in layers], 0.0),
            sums([x.activation_bytes for x in layers], 0.0),
            np.asarray(graph.cut_bytes(), dtype=np.float64),
        )

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

"""The synchronous objective: one update of a flushed pipeline, priced from its stages.

``d`` copies of a pipeline of ``p`` stages each run ``m`` microbatches an update, then
flush. Stage ``c`` takes ``tau_c`` per microbatch on a replica, ``cut_c`` to send its
output and take back the gradient, and ``x_c`` more at the update's end:

    T = max_c g_c  +  max_c y_c  +  max_c x_c,                     u_c = tau_c + cut_c

    1f1b-flush         g_c = (m + p - 1) u_c,      y_c = 0
    zb-h1, m >= p      g_c = m u_c - (p - 1) W_c,  y_c = (p - 1)(u_c - W_c)   (W_c <= u_c / 2)
    interleaved-1f1b   g_c = (v m + p - 1) u_c,    y_c = 0, on p v chunks

``W_c``: the stage's weight gradient. The simulator's time for equal stages without cuts
(Narayanan et al. 2021; Qi et al. 2023 for ZB-H1) and above it otherwise; why, and why
each term is one stage's own so that :mod:`.sync_dp` minimises ``T`` exactly:
docs/planner.md, "The synchronous objective". ``g_c + y_c`` is at least :func:`factor`
times ``u_c``, which the search's floors use. :func:`slots` says where each stage sits,
what it holds and its share of the memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from dreampipe.errors import PlanError
from dreampipe.planning.interleave_order import chunk_peaks

FloatArray = npt.NDArray[np.float64]

__all__ = ["PipelineKind", "Slots", "factor", "slots"]


class PipelineKind(StrEnum):
    """The synchronous schedules the objective prices (named as the schedules are)."""

    FLUSH = "1f1b-flush"
    ZB_H1 = "zb-h1"
    INTERLEAVED = "interleaved-1f1b"


@dataclass(frozen=True)
class Slots:
    """Stage ``c`` of a pipeline (a chunk under interleaving) sits on worker block
    ``blocks[c]``, holds ``in_flight[c]`` microbatches at its peak and must fit
    ``memory_share`` of a worker's memory; a stage's terms (module doc) are ``g = scale u
    - credit W`` (:meth:`value`) and ``y = credit (u - W)`` (:meth:`lift`), ``W`` at most
    ``u / 2``; ``g + y`` is at least ``least u``."""

    blocks: tuple[int, ...]
    in_flight: tuple[int, ...]
    memory_share: float
    scale: float
    least: float
    credit: float = 0.0

    @property
    def count(self) -> int:
        return len(self.blocks)

    def value(self, u: FloatArray, weight_grad: FloatArray) -> FloatArray:
        """The term ``g`` of stages whose ``tau + cut`` is ``u`` and weight gradient
        ``weight_grad`` (arrays of one shape), written over ``u``: the program's inner
        loop makes no array it does not keep."""
        if self.credit:
            u -= (self.credit / self.scale) * np.minimum(weight_grad, u / 2)
        u *= self.scale
        return u

    def lift(self, u: FloatArray, weight_grad: FloatArray) -> FloatArray:
        """The term ``y`` of the same stages (a new array; zeros without a credit)."""
        if not self.credit:
            return np.zeros_like(u)
        return self.credit * (u - np.minimum(weight_grad, u / 2))

    def term(self, u: float, weight_grad: float) -> float:
        """One stage's own ``g + y``: its update were it the pipeline's every term."""
        v, w = np.array(u), np.array(weight_grad)
        return float(self.lift(v, w) + self.value(v.copy(), w))


def slots(kind: PipelineKind, p: int, m: int, v: int = 1, rho: float = 0.0) -> Slots:
    """Where each stage of ``kind`` with ``p`` workers in a pipeline, ``m`` microbatches a
    copy and ``v`` chunks a worker sits, and the update's factor.

    1F1B-flush holds ``min(p - c, m)`` microbatches on stage ``c``. ZB-H1 holds
    ``min(p, m)`` on every stage: a microbatch stays until its ``W``, and stage ``c`` runs
    ``p - c`` forwards ahead and puts its ``W`` off by ``c``
    (:mod:`~dreampipe.scheduling.zero_bubble`); its peak over workers is 1F1B's, not
    each stage's. ZB-H1
    fills a stage's drain with its own weight gradients, one on each of the ``p - 1``
    bubble slots, each slot at most the largest ``u - W``; with fewer microbatches than
    stages it has too few weight gradients to fill its bubble and is priced as
    1F1B-flush.
    Under interleaving each chunk holds the most microbatches it holds at once in
    Megatron-LM's order (:func:`~.interleave_order.chunk_peaks`; worker 0 of 8 with 3
    chunks: 16, 15 and 8, where its warm-up alone runs 30 forwards), in ``1 / v`` of the
    memory: the chunks' peaks sum to at least the worker's. ``rho``: as :func:`factor`'s.
    """
    phi = factor(kind, p, m, v, rho)
    if kind is PipelineKind.INTERLEAVED:
        peaks = chunk_peaks(p, v, m)
        return Slots(tuple(c % p for c in range(p * v)),
                     tuple(peaks[c % p][c // p] for c in range(p * v)), 1.0 / v, phi, phi)
    if kind is PipelineKind.ZB_H1:
        peak = (min(p, m),) * p
        if m >= p:
            return Slots(tuple(range(p)), peak, 1.0, float(m), phi, float(p - 1))
        return Slots(tuple(range(p)), peak, 1.0, phi, phi)
    peak = tuple(min(p - c, m) for c in range(p))
    return Slots(tuple(range(p)), peak, 1.0, phi, phi)


def factor(kind: PipelineKind, p: int, m: int, v: int = 1, rho: float = 0.0) -> float:
    """What a stage's term of ``kind`` is at least per second of its ``tau + cut``
    (module doc), without the slots: the search prices every choice's floor with it.
    ZB-H1's is ``m + (p - 1) rho`` where no stage's weight gradient is more than
    ``(1 - rho) / 2`` of its ``tau + cut`` (``rho`` 0: its bubble credited in full)."""
    if p < 1 or m < 1 or v < 1:
        raise PlanError(f"p={p}, m={m}, v={v}: give whole numbers >= 1")
    if kind is PipelineKind.INTERLEAVED:
        if v < 2 or m % p:
            raise PlanError(f"interleaved-1f1b with v={v}, m={m} on p={p}: it needs v >= 2 "
                            f"and m a multiple of p ({p}), as Megatron-LM runs it")
        return float(v * m + p - 1)
    if v != 1:
        raise PlanError(f"{kind.value} runs one stage a worker, not v={v}; use "
                        "interleaved-1f1b for virtual stages")
    if kind is PipelineKind.ZB_H1 and m >= p:
        return m + (p - 1) * max(0.0, min(1.0, rho))
    return float(m + p - 1)

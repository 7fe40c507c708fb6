"""The synchronous objective: one update of a flushed pipeline, priced from its stages.

``d`` copies of a pipeline of ``p`` stages each run ``m`` microbatches an update, then
flush. Stage ``c`` takes ``tau_c`` per microbatch on a replica (forward, backward,
recomputation), ``cut_c`` to send its output and take back the gradient, and ``x_c``
more at the update's end (the all-reduce left after its last backward, ZeRO's gather):

    T = max over c of phi (tau_c + cut_c)  +  max over c of x_c

    1f1b-flush         phi = m + p - 1                 (bubble (p - 1) / m)
    zb-h1              phi = m + (p - 1) rho, m >= p   (rho = (F + B - 2W) / (F + B))
    interleaved-1f1b   phi = v m + p - 1, on p v chunks (bubble (p - 1) / (v m))

the simulator's time for equal stages without cuts (Narayanan et al. 2021; Qi et al.
2023 for ZB-H1, ``W`` the weight-gradient part of ``B``) and above it otherwise (a
period is at most the largest ``tau + cut``, docs/planner.md, "The synchronous
objective"). For a fixed ``(kind, p, v, m)``, ``phi`` is one number, and the dynamic
program (:mod:`.sync_dp`) minimises ``T`` exactly. :func:`slots` says where each stage
sits, what it holds and its share of the memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from dreampipe.errors import PlanError
from dreampipe.profiling.graph import LayerGraph

__all__ = ["PipelineKind", "Slots", "factor", "slots", "zero_bubble_ratio"]


class PipelineKind(StrEnum):
    """The synchronous schedules the objective prices (named as the schedules are)."""

    FLUSH = "1f1b-flush"
    ZB_H1 = "zb-h1"
    INTERLEAVED = "interleaved-1f1b"


@dataclass(frozen=True)
class Slots:
    """Stage ``c`` of a pipeline (a chunk under interleaving) sits on worker block
    ``blocks[c]``, holds ``in_flight[c]`` microbatches at its peak and must fit
    ``memory_share`` of a worker's memory; ``factor`` is ``phi`` (module doc)."""

    blocks: tuple[int, ...]
    in_flight: tuple[int, ...]
    memory_share: float
    factor: float

    @property
    def count(self) -> int:
        return len(self.blocks)


def slots(kind: PipelineKind, p: int, m: int, v: int = 1, rho: float = 1.0) -> Slots:
    """Where each stage of ``kind`` with ``p`` workers in a pipeline, ``m`` microbatches a
    copy and ``v`` chunks a worker sits, and the update's factor.

    1F1B (flush and ZB-H1) holds ``min(p - c, m)`` microbatches on stage ``c``; ZB-H1
    with fewer microbatches than stages has too few weight gradients to fill its bubble
    and is priced as 1F1B-flush.
    Interleaving's worker ``w`` runs ``2 (p - w - 1) + (v - 1) p`` chunk forwards before
    its first backward, so it holds one more than that (at most ``v m``); each chunk is
    held to ``1 / v`` of the memory with as many of its own microbatches, at most ``m``,
    a bound on the worker's sum (exact when its chunks hold alike).
    """
    phi = factor(kind, p, m, v, rho)
    if kind is PipelineKind.INTERLEAVED:
        held = [min(2 * (p - w - 1) + (v - 1) * p + 1, v * m, m) for w in range(p)]
        return Slots(tuple(c % p for c in range(p * v)), tuple(held[c % p] for c in range(p * v)),
                     1.0 / v, phi)
    return Slots(tuple(range(p)), tuple(min(p - c, m) for c in range(p)), 1.0, phi)


def factor(kind: PipelineKind, p: int, m: int, v: int = 1, rho: float = 1.0) -> float:
    """``phi`` of ``kind`` (module doc), without the slots: the search prices every
    choice's floor with it."""
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
    ratio = rho if kind is PipelineKind.ZB_H1 and m >= p else 1.0
    return m + (p - 1) * ratio


def zero_bubble_ratio(graph: LayerGraph) -> float:
    """``rho``: ZB-H1's bubble over 1F1B's, ``(F + B - 2W) / (F + B)`` over the model's
    layers (``Input`` nodes left out), 1/3 when the weight gradient is half the backward;
    exact for stages that share the model's mix of forward, backward and weight gradient,
    as a transformer's blocks do."""
    work = [x for x in graph.layers if not x.is_input]
    fwd = sum(x.forward_ms for x in work)
    bwd = sum(x.backward_ms for x in work)
    wgrad = sum(x.backward_ms * x.weight_grad_share for x in work)
    return max(0.0, fwd + bwd - 2 * wgrad) / (fwd + bwd) if fwd + bwd > 0 else 1.0

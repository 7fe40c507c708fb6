"""One way to run a stage of a synchronous plan: its split, its recomputation, its ZeRO level.

:class:`StageOption` is what the dynamic program chooses per stage
(:mod:`dreampipe.planning.sync_tables` prices each); recomputation runs the whole
stage's forward again, or block by block its first ``k`` blocks, the transformer layers
:func:`layer_blocks` finds in a profile by shape (docs/planner.md, "The synchronous
objective"); :func:`block_mask`, :func:`block_span` and :func:`recomputed_peak` say which
layers those are and what the largest keeps.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from dreampipe.planning.split_ranges import StageSplit
from dreampipe.profiling.gpt_shapes import block_index
from dreampipe.profiling.graph import LayerGraph

__all__ = ["Recompute", "StageOption", "block_mask", "block_span", "layer_blocks",
           "recomputed_peak", "twin_bases"]

_Blocks = tuple[int | None, ...]


class Recompute(StrEnum):
    """What a stage recomputes in its backward."""

    NONE = "none"
    STAGE = "stage"  #: the whole stage's forward: keeps its input per microbatch
    BLOCKS = "blocks"  #: its first k blocks: keeps each one's input per microbatch


@dataclass(frozen=True)
class StageOption:
    """One way to run a stage: ``split`` (None: unsplit), what it recomputes and the ZeRO
    level its replicas shard at."""

    split: StageSplit | None = None
    recompute: Recompute = Recompute.NONE
    blocks: int = 0
    zero: int = 0

    @property
    def label(self) -> str:
        what = {Recompute.NONE: "", Recompute.STAGE: "r",
                Recompute.BLOCKS: f"r{self.blocks}"}[self.recompute]
        return (f"t{self.split.t}" if self.split else "") + what + \
            (f"z{self.zero}" if self.zero else "")


def layer_blocks(graph: LayerGraph) -> tuple[int | None, ...]:
    """Each layer's block (a transformer layer ``bK.`` of a profile by shape), None for
    layers outside blocks (the embedding, the head)."""
    return tuple(block_index(x.name) for x in graph.layers)


@functools.lru_cache(maxsize=8)
def block_mask(blocks: _Blocks, k: int) -> npt.NDArray[np.bool_]:
    """``[i, l]``: layer ``l >= i`` is in one of the first ``k`` blocks from layer ``i``
    (``blocks``: each layer's, :func:`layer_blocks`)."""
    n = len(blocks)
    first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    nxt = np.iinfo(np.int64).max
    for i in reversed(range(n)):
        b = blocks[i]
        nxt = b if b is not None else nxt
        first[i] = nxt
    ids = np.array([-1 if b is None else b for b in blocks], dtype=np.int64)
    later = np.arange(n)[None, :] >= np.arange(n)[:, None]
    mask = np.asarray(later & (ids[None, :] >= 0) & (ids[None, :] >= first[:, None])
                      & (ids[None, :] < first[:, None] + k))
    mask.flags.writeable = False  # cached: shared by every caller
    return mask


@functools.lru_cache(maxsize=8)
def block_span(blocks: _Blocks, k: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(start, stop)`` by a stage's first layer: the first and the last layer of its
    first ``k`` blocks (``start`` n and ``stop`` -1 where it has none)."""
    mask = block_mask(blocks, k)
    n = len(blocks)
    cols = np.arange(n)
    start = np.where(mask.any(axis=1), np.argmax(mask, axis=1), n)
    stop = np.where(mask, cols[None, :], -1).max(axis=1)
    start.flags.writeable = stop.flags.writeable = False  # cached: shared by every caller
    return start, stop


def recomputed_peak(blocks: _Blocks, layer_kept: npt.NDArray[np.float64], k: int
                    ) -> npt.NDArray[np.float64]:
    """``[i, j]``: what a stage of layers ``i..j`` recomputing its first ``k`` blocks holds
    once while one backward recomputes a block: the most any of those blocks keeps of
    its layers in ``i..j`` (``layer_kept`` each layer's; 0 where none is recomputed)."""
    mask = block_mask(blocks, k)
    n = len(blocks)
    ids = np.array([-1 if b is None else b for b in blocks], dtype=np.int64)
    starts = np.ones(n, dtype=bool)
    starts[1:] = ids[1:] != ids[:-1]
    within = np.zeros(n, dtype=np.float64)  # each block's kept from its start up to l
    for col in range(n):
        within[col] = layer_kept[col] + (0.0 if starts[col] else within[col - 1])
    out = np.zeros((n, n), dtype=np.float64)
    for i in range(n):
        sums = within - (within[i - 1] if i > 0 and not starts[i] else 0.0) * (ids == ids[i])
        out[i] = np.maximum.accumulate(np.where(mask[i], sums, 0.0))
    return out


def twin_bases(options: Sequence[StageOption], by_split: bool = False) -> tuple[int, ...]:
    """Each option's first twin: the same split, recomputation and blocks, at any ZeRO
    level (``by_split``: the same split, any way it recomputes)."""
    first: dict[tuple[object, ...], int] = {}
    return tuple(first.setdefault((id(o.split),) if by_split else
                                  (id(o.split), o.recompute, o.blocks), x)
                 for x, o in enumerate(options))

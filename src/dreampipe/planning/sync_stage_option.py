"""One way to run a stage of a synchronous plan: its split, its recomputation, its ZeRO level.

:class:`StageOption` is what the dynamic program chooses per stage
(:mod:`dreampipe.planning.sync_tables` prices each); recomputation runs the whole
stage's forward again, or block by block its first ``k`` blocks, the transformer layers
:func:`layer_blocks` finds in a profile by shape (docs/planner.md, "The synchronous
objective").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from dreampipe.planning.split_ranges import StageSplit
from dreampipe.profiling.gpt_shapes import block_index
from dreampipe.profiling.graph import LayerGraph

__all__ = ["Recompute", "StageOption", "layer_blocks"]


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

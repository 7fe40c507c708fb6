"""What the synchronous search may choose, and the choices it enumerates outside the program.

:class:`SyncOptions` is the search's input; :func:`copies_tried`, :func:`divisors` and
:func:`stage_counts` list the copies of the pipeline, the microbatch sizes and the stage
counts that :mod:`dreampipe.planning.sync_search` tries (docs/planner.md, "The
synchronous objective"); :func:`check_whole_blocks` checks a search of whole blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from dreampipe.errors import ConfigError, PlanError
from dreampipe.planning.layout import Layout
from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync import DEFAULT_SYNC, Sync
from dreampipe.planning.sync_objective import PipelineKind

__all__ = ["ZERO_LEVELS", "SyncOptions", "check_whole_blocks", "copies_tried", "divisors",
           "stage_counts"]

#: The ZeRO levels a search offers each replicated stage by default.
ZERO_LEVELS = (0, 1, 2, 3)


@dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """What :func:`plan_sync` may choose. ``global_batch`` samples an update (in the
    profile's samples; a profile without its batch size counts its minibatches);
    ``microbatch_size`` fixes ``b``; ``memory_bytes`` per worker (None: no limit);
    ``training`` the number formats and optimizer; ``kinds`` the schedules allowed;
    ``layout`` fixes part of the layout; ``recompute`` lets a stage recompute whole
    where only that fits; ``recompute_blocks`` also lets it recompute every block one at a
    time (Megatron-LM's full recomputation), which a layout's search always weighs and
    the free search, several times longer, weighs only when asked; ``tensor_split``
    lets replicas split over a server's workers;
    ``whole_blocks`` gives every stage the same number of whole blocks, as Megatron-LM
    places them (:func:`~dreampipe.planning.sync_dp.whole_block_starts`), instead of the
    best cuts; ``zero_levels`` the ZeRO levels each replicated stage chooses among (None:
    every level, or the one the layout names; docs/planner.md)."""

    global_batch: int
    microbatch_size: int | None = None
    memory_bytes: int | None = None
    training: Training = field(default_factory=Training)
    sync: Sync = DEFAULT_SYNC
    kinds: tuple[PipelineKind, ...] = tuple(PipelineKind)
    layout: Layout | None = None
    recompute: bool = False
    recompute_blocks: bool = False
    tensor_split: bool = True
    whole_blocks: bool = False
    zero_levels: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        levels = self.zero_levels
        if levels is not None and (not levels or len(set(levels)) < len(levels)
                                   or not set(levels) <= set(ZERO_LEVELS)):
            raise ConfigError(f"zero_levels={','.join(map(str, levels))}; give distinct "
                              "ZeRO levels from 0 to 3, e.g. 0,1 to shard no more than the "
                              "optimizer's state, or none for every level", "zero_levels")
        if self.layout is not None and self.layout.zero is not None and levels is not None:
            raise ConfigError(f"zero_levels={','.join(map(str, levels))} with layout "
                              f"{self.layout.text}, which fixes level {self.layout.zero}: "
                              "drop z from the layout, or the levels", "zero_levels")
        if self.recompute_blocks and not self.recompute:
            raise ConfigError("recompute_blocks=True with recompute=False: block-by-block "
                              "recomputation is recomputation; allow it (drop "
                              "--no-recompute) or drop --recompute-blocks", "recompute_blocks")
        if self.global_batch < 1:
            raise ConfigError(f"global_batch={self.global_batch}; give the samples of one "
                              "update, a whole number >= 1, e.g. 512", "global_batch")
        if self.microbatch_size is not None and not 1 <= self.microbatch_size <= \
                self.global_batch:
            raise ConfigError(f"microbatch_size={self.microbatch_size}; give a whole number "
                              f"from 1 to the global batch {self.global_batch} that divides "
                              "its share of each copy of the pipeline", "microbatch_size")
        b, batch = self.microbatch_size, self.global_batch
        if b is not None and batch % b:
            divisors = [str(k) for k in range(1, batch + 1) if batch % k == 0]
            shown = ", ".join(divisors[:6]) + (", ..." if len(divisors) > 6 else "")
            raise ConfigError(
                f"microbatch_size={b} does not divide the global batch of {batch}: each copy "
                f"of the pipeline runs whole microbatches of its share; give a divisor of "
                f"{batch} ({shown}) or a global batch that is a multiple of {b} "
                f"({batch - batch % b or b}, {batch - batch % b + b})", "microbatch_size")
        if not self.kinds:
            raise ConfigError("kinds=(): allow at least one schedule, e.g. 1f1b-flush",
                              "kinds")


def copies_tried(batch: int, workers: int, t: int, layout: Layout | None,
                 server: int | None = None) -> list[int]:
    """The copies of the pipeline tried: those that divide ``batch`` on ``t`` workers a
    replica; a layout's fill the workers, its ``t`` inside one ``server`` of that many
    workers (a split's collectives are priced on the server's link)."""
    if layout is None:
        return [d for d in range(1, workers // t + 1) if batch % d == 0]
    if server is not None and layout.t > server:
        raise PlanError(f"layout {layout.text}: a tensor split of t = {layout.t} runs inside "
                        f"one server, whose link its collectives cross each layer, and a "
                        f"server here has {server} workers: give t at most {server}")
    d = workers // (layout.t * layout.p)
    if d < 1:
        raise PlanError(f"layout {layout.text} needs {layout.t * layout.p} workers; the "
                        f"topology has {workers}: give a smaller t or p")
    if batch % d:
        raise PlanError(f"layout {layout.text} on {workers} workers runs d = {d} copies of "
                        f"the pipeline, which do not divide the global batch {batch}: give "
                        f"a global batch that {d} divides, e.g. {batch // d * d or d}")
    return [d]


def stage_counts(kind: PipelineKind, v: int, m: int, n: int, stages: list[int]
                  ) -> Iterator[list[int]]:
    """The stage counts of ``stages`` (most first) that ``kind`` runs with ``v`` chunks a
    worker and ``m`` microbatches, in runs whose floors rise as they go
    (:meth:`~dreampipe.planning.sync_search.SyncSearch.families`)."""
    if kind is PipelineKind.INTERLEAVED:
        yield [p for p in stages if p > 1 and m % p == 0 and p * v <= n]
    elif kind is PipelineKind.ZB_H1:
        yield [p for p in stages if p > m]
        yield [p for p in stages if p <= m]
    else:
        yield stages


def divisors(k: int) -> list[int]:
    """Every whole number that divides ``k``."""
    return [x for x in range(1, k + 1) if k % x == 0]


def check_whole_blocks(blocks: tuple[int | None, ...], layout: Layout | None,
                       model: str) -> None:
    """Whole blocks need blocks, and a layout's stages must share them evenly."""
    count = len({b for b in blocks if b is not None})
    if not count:
        raise PlanError(f"whole blocks a stage, but profile {model} has no blocks (a gpt: "
                        "profile's transformer layers); drop --whole-blocks")
    if layout is None:
        return
    chunks = layout.p * (layout.v or 1)  # without v, p must divide them at least
    if count % chunks:
        raise PlanError(f"layout {layout.text} cuts {count} blocks into {chunks} stages of "
                        "whole blocks, which do not divide them; give "
                        f"{'p v' if layout.v else 'p'} dividing {count}, or drop "
                        "--whole-blocks")

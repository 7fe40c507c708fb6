"""What one synchronous search reads: the profile as trained, each width's stage options,
the ZeRO levels a stage may take and each choice's tables.

:class:`SearchInputs` checks a layout against the profile, lists a stage's options (the
one place that does), and builds :class:`~dreampipe.planning.sync_tables.StageTables`
once per choice of ``t``, ``d`` and ``b``; :mod:`dreampipe.planning.sync_choice_floors`
bounds the choices and :mod:`dreampipe.planning.sync_search` searches them
(docs/planner.md, "The synchronous objective").
"""

from __future__ import annotations

import functools
from dataclasses import replace

from dreampipe.errors import PlanError
from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.memory_terms import OptimizerTerms
from dreampipe.planning.split_ranges import split_options
from dreampipe.planning.state_bytes import profiled_param_bytes
from dreampipe.planning.sync_choices import ZERO_LEVELS, SyncOptions, check_whole_blocks
from dreampipe.planning.sync_stage_option import Recompute, StageOption, layer_blocks
from dreampipe.planning.sync_tables import StageTables, TableInputs
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph

__all__ = ["SearchInputs"]


class SearchInputs:
    """One search's inputs: the profile with its weights as trained, each ``t``'s stage
    options and each choice's tables, built once."""

    def __init__(self, graph: LayerGraph, topology: Topology, opts: SyncOptions) -> None:
        self.graph, self.topology, self.opts = graph, topology, opts
        self.trained = opts.training.trained(graph)
        blocks = layer_blocks(graph)
        self.inputs = TableInputs(
            self.trained, RangeCosts.of(self.trained), topology, opts.sync, opts.training,
            profiled_param_bytes(graph), blocks, tuple(x.weight_grad_share for x in graph.layers))
        self.base = graph.batch_size or 1
        #: the profile's blocks: recomputing its first that many, a stage recomputes all of its
        self.block_count = len({b for b in blocks if b is not None})
        layout = opts.layout
        n = self.inputs.costs.n
        if layout is not None and layout.p * (layout.v or 1) > n:
            raise PlanError(f"layout {layout.text} cuts {n} layers into "
                            f"{layout.p * (layout.v or 1)} stages; give at most one stage a "
                            "layer: a smaller p or v")
        if layout is not None and layout.recompute_blocks and not any(
                b is not None for b in blocks):
            raise PlanError(f"layout {layout.text} recomputes {layout.recompute_blocks} blocks "
                            f"a stage, but profile {graph.model or 'model'} has no blocks (a "
                            "gpt: profile's transformer layers); drop -r")
        if opts.recompute_blocks and not self.block_count:
            raise PlanError(f"recompute_blocks=True, but profile {graph.model or 'model'} has "
                            "no blocks (a gpt: profile's transformer layers) to recompute one "
                            "at a time; drop --recompute-blocks")
        if opts.whole_blocks:
            check_whole_blocks(blocks, layout, graph.model or "model")

    @functools.cached_property
    def _split_state(self) -> OptimizerTerms:
        """The optimizer's state (and 16-bit weights' masters) per byte of weights as
        trained, beside the weights and their gradient: what picks a split's leanest."""
        kept = self.opts.training.state_per_byte(profiled_param_bytes(self.graph))
        return OptimizerTerms(state_copies=max(0.0, kept - 2.0))

    @functools.cache  # noqa: B019 - one search, dropped with it
    def options(self, t: int) -> tuple[StageOption, ...]:
        """Every way a stage may run on replicas of ``t`` workers: the one place that
        lists a stage's choices."""
        splits: list[StageOption | None] = [StageOption()] if t == 1 else [
            StageOption(split=x) for x in split_options(self.trained, self.topology, [t],
                                                        self._split_state)]
        layout = self.opts.layout
        out: list[StageOption] = []
        for base in splits:
            assert base is not None
            if layout is not None and layout.recompute_blocks is not None:
                out.append(replace(base, recompute=Recompute.BLOCKS,
                                   blocks=layout.recompute_blocks)
                           if layout.recompute_blocks else base)
                continue
            out.append(base)
            if self.opts.recompute:
                out.append(replace(base, recompute=Recompute.STAGE))
                # a layout's search is small, so it weighs it too; the free one when asked
                if self.block_count and (layout is not None or self.opts.recompute_blocks):
                    out.append(replace(base, recompute=Recompute.BLOCKS,
                                       blocks=self.block_count))
        return tuple(out)

    def zero_levels(self, d: int) -> tuple[int, ...]:
        """The ZeRO levels a stage on ``d`` replicas may shard at, each stage choosing its
        own as one more option: the layout's level where it names one, else the
        options' ``zero_levels`` (every level by default); on one replica every level is
        level 0."""
        layout = self.opts.layout
        if layout is not None and layout.zero is not None:
            return (layout.zero,)
        if d < 2:
            return (0,)
        return self.opts.zero_levels if self.opts.zero_levels is not None else ZERO_LEVELS

    @functools.lru_cache(maxsize=8)  # noqa: B019 - one search, dropped with it
    def tables(self, t: int, d: int, b: int, splits_backward: bool) -> StageTables:
        options = [replace(o, zero=z) for o in self.options(t) for z in self.zero_levels(d)]
        return StageTables(self.inputs, options, t, d, b / self.base, splits_backward)

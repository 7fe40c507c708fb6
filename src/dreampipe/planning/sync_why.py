"""Why each stage of a synchronous plan runs as it does: every option it could have taken.

For each stage of a :class:`~dreampipe.planning.sync_plan.SyncPlan`, every option of its
tables (the split variants of its ``t``, keeping or recomputing, the ZeRO level) priced
on the same layers, slot and microbatches as the program priced them: its pipeline term
``g`` (:meth:`~dreampipe.planning.sync_objective.Slots.term`), its tail and its memory,
and whether it fits. The program kept the option of least term among those that fit with
a tail the plan allows, so these say what each other choice would have cost or why it
could not be taken (docs/planner.md, "The synchronous objective").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dreampipe.planning.splits import Split
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_objective import PipelineKind, slots
from dreampipe.planning.sync_plan import SyncPlan
from dreampipe.planning.sync_search import SyncSearch
from dreampipe.planning.sync_stage_option import StageOption
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph

__all__ = ["OptionPrice", "stage_options"]


@dataclass(frozen=True)
class OptionPrice:
    """One option of a stage on the plan's layers: ``label`` as the plan writes options,
    its pipeline term ``value_s`` (the stage's ``g``), ``tail_s``, ``memory_bytes`` per
    worker holding the stage's microbatches, whether that fits, and whether the plan
    runs it."""

    label: str
    value_s: float
    tail_s: float
    memory_bytes: float
    fits: bool
    chosen: bool

    def to_dict(self) -> dict[str, object]:
        return {"option": self.label, "value_s": self.value_s, "tail_s": self.tail_s,
                "memory_bytes": self.memory_bytes, "fits": self.fits, "chosen": self.chosen}


def stage_options(graph: LayerGraph, topology: Topology, options: SyncOptions,
                  plan: SyncPlan) -> list[list[OptionPrice]]:
    """Every option of each stage of ``plan`` (module doc), as ``plan_sync(graph,
    topology, options)`` priced them."""
    search = SyncSearch(graph, topology, options)
    sl = slots(plan.schedule, plan.pipeline, plan.microbatches, plan.virtual_stages)
    tables = search.tables(plan.tensor_parallel, plan.data_parallel, plan.microbatch_size,
                           plan.schedule is PipelineKind.ZB_H1)
    limit = options.memory_bytes
    variants = list(dict.fromkeys(o.split.splits for o in tables.options if o.split))
    out = []
    for c, st in enumerate(plan.stages):
        block = sl.blocks[c]
        cut = 0.0 if c + 1 == sl.count else float(
            tables.cut(block, sl.blocks[c + 1])[st.last])
        prices = []
        for x, option in enumerate(tables.options):
            tau, tail, wgrad = tables.time_at(x, block, st.first, st.last)
            fits = limit is None or tables.fits(x, sl.in_flight[c], limit * sl.memory_share,
                                                st.first, st.last)
            prices.append(OptionPrice(
                _label(option, variants), sl.term(tau + cut, wgrad), tail,
                tables.memory_at(x, sl.in_flight[c], st.first, st.last), fits,
                _key(option) == _key(st.option)))
        out.append(prices)
    return out


def _label(option: StageOption, variants: Sequence[tuple[Split, ...]]) -> str:
    """``option``'s label, naming its split where ``t`` has several (the operator
    search's fastest and leanest)."""
    label = option.label or "-"
    if option.split is not None and len(variants) > 1:
        label += f" (split {variants.index(option.split.splits) + 1} of {len(variants)})"
    return label


def _key(option: StageOption) -> tuple[object, ...]:
    """What tells two options apart across searches (their splits are rebuilt, equal by
    the layers' splits, not by identity)."""
    return (None if option.split is None else option.split.splits, option.recompute,
            option.blocks, option.zero)

"""The plan a Pipeline settles on, checked against its model and world.

Split points become a :class:`~dreampipe.planning.plan.Plan`; the plan is
resolved (:func:`~dreampipe.api.plans.resolve_plan`: given, read, or profiled
and planned on rank 0, with the schedule ``"auto"`` chose); then every rank
checks it against the model's layers, the world, the config and the weights
tied across its stages, and runs its stages on ``meta``, all before anything
is sent, so each rank raises the same error at the same point.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from dreampipe.api.checks import (
    Batch,
    check_counted_targets,
    check_plan,
    check_schedule,
    check_split,
    check_stages_on_meta,
    check_stages_per_rank,
)
from dreampipe.api.config import TrainConfig
from dreampipe.api.plans import PlanArg, resolve_plan
from dreampipe.api.ties import check_ties
from dreampipe.errors import ConfigError
from dreampipe.planning.placement import Placement
from dreampipe.planning.plan import Plan
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout
from dreampipe.splitter.chain import Layers, Tie, tied_parameters
from dreampipe.splitter.segments import Segment, split_bounds
from dreampipe.splitter.state_keys import check_written_buffers

__all__ = ["SettledPlan", "check_split_stages", "settle_plan"]


@dataclass(frozen=True)
class SettledPlan:
    """What :func:`settle_plan` decided."""

    plan: Plan
    #: The config that runs: the schedule ``"auto"`` chose, the plan's stages per worker.
    config: TrainConfig
    #: The microbatches of that schedule, over every worker of a split stage.
    layout: MicrobatchLayout
    ties: list[Tie]


def settle_plan(
    model: nn.Module,
    layers: Layers,
    plan: PlanArg,
    *,
    example: Batch,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    config: TrainConfig,
    layout: MicrobatchLayout,
    world: int,
) -> SettledPlan:
    """The plan ``Pipeline(plan=...)`` runs ``layers`` of ``model`` with, checked.

    ``layout``: the microbatches of ``config``'s schedule, before any choice."""
    if not isinstance(plan, Plan | str | os.PathLike | list | tuple):
        raise ConfigError(f"plan={plan!r}: give 'auto' (the default: dreampipe profiles and "
                          "plans), a Plan, a plan file's path, or a list of split points",
                          "plan")
    check_counted_targets(model, example, config)
    names = [name for name, _ in layers]
    microbatch_size = layout.microbatch_size
    if isinstance(plan, list | tuple):  # split points
        bounds = split_bounds(names, plan, model)
        v = config.stages_per_rank
        check_stages_per_rank(len(bounds), v, world)
        plan = Plan.from_config(len(names), bounds, [1] * len(bounds),
                                layer_names=tuple(names), virtual_stages=v,
                                placement=config.kind.placement if v > 1 else Placement.LOOP)
    resolved = resolve_plan(plan, layers=layers, example=example, loss_fn=loss_fn,
                            microbatch_size=microbatch_size, config=config)
    plan = resolved.plan
    v = plan.virtual_stages
    if resolved.kind is not None:
        config = config.chosen(resolved.kind, resolved.microbatches)
        layout = MicrobatchLayout(kind=resolved.kind, minibatch_size=int(example[1].shape[0]),
                                  microbatches=resolved.microbatches, workers=world)
    config = dataclasses.replace(config, virtual_stages=v)
    check_stages_per_rank(plan.num_stages, v, world, [st.replicas for st in plan.stages])
    check_plan(plan, names, world)
    ties = tied_parameters(layers, [st.first for st in plan.stages])
    check_written_buffers(layers, [st.first for st in plan.stages])
    check_ties(ties, plan, config.kind)
    t = max(st.tensor_parallel for st in plan.stages)
    if v > 1 and t > 1:
        raise ConfigError(f"virtual_stages={v} with stages split over workers is not "
                          "supported yet; use virtual_stages=1", "virtual_stages")
    check_schedule(config, plan)
    if t > 1:
        check_split(plan, config)
        check_split_stages(layers, plan)
        layout = dataclasses.replace(layout, workers=sum(st.replicas for st in plan.stages))
    check_stages_on_meta(layers, plan, example, loss_fn, microbatch_size)
    return SettledPlan(plan=plan, config=config, layout=layout, ties=ties)


def check_split_stages(layers: Layers, plan: Plan) -> None:
    """What each stage ``plan`` splits over workers can hold of ``layers``
    (:func:`~dreampipe.runtime.tensor_split.check_split_layers`), and that they each take
    and give one tensor (an ``nn.Sequential``'s children): not the segments of a traced
    model, which pass packs of values."""
    from dreampipe.runtime.tensor_split import check_split_layers  # DTensor's: on use

    for s, st in enumerate(plan.stages):
        if st.tensor_parallel == 1:
            continue
        held = layers[st.first : st.last + 1]
        traced = next((name for name, layer in held if isinstance(layer, Segment)), None)
        if traced is not None:
            raise ConfigError(
                f"plan {plan.config} splits stage {s} over workers, but its layer {traced!r} "
                "is a segment of a traced model (not an nn.Sequential of modules each taking "
                "one tensor), which a split stage cannot run yet; use a plan with no split",
                "plan")
        check_split_layers(held, st.splits, s)

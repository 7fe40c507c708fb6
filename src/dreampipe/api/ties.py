"""Weights tied across stages: each stage holds a copy, and the copies stay equal.

A parameter shared by layers of several stages (GPT-2's input embedding and
output head, tied by ``tie_weights``) lives on each of those stages, as
DeepSpeed's ``TiedLayerSpec`` does. The first stage's value is broadcast to
the others before training (a model built on ``meta`` initialises each copy
on its own), and every update sums the copies' gradients over the stages
first (:meth:`~dreampipe.runtime.stage_module.StageModule.tie`), so each applies the
same change and training equals one process. Each stage stashes its copy
with its own weight versions; the state dict has the parameter under every
stage's name, with one value.

A tied stage may be replicated: its replicas' gradients are summed first (its
``ALLREDUCE``), so only its first replica adds its sum to the tie's, the others
add zeros, and every copy takes the same total. Ties are honoured without tensor
splitting or gradient clipping; anything else is a ConfigError before training.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dreampipe.errors import ConfigError
from dreampipe.planning.plan import Plan
from dreampipe.runtime.stage_module import StageModule
from dreampipe.splitter.chain import Tie

__all__ = ["check_ties", "tie_stages"]


def check_ties(ties: list[Tie], plan: Plan, max_grad_norm: float | None) -> None:
    """The ties must be ones the Pipeline can keep equal (see the module docstring)."""
    for tie in ties:
        what = (f"parameter {tie.names[0]!r} is tied to {', '.join(map(repr, tie.names[1:]))} "
                f"on stages {', '.join(map(str, tie.stages))}")
        if plan.has_splits:
            raise ConfigError(
                f"{what}, which plan {plan.config} splits over workers; a tied weight is kept "
                "on stages with no split: use such a plan, or split points that put the tied "
                "layers on one stage", "plan")
        if max_grad_norm is not None:
            raise ConfigError(
                f"{what}; clipping by the global norm with a weight tied across stages is not "
                "supported yet: drop max_grad_norm, or put the tied layers on one stage",
                "max_grad_norm")


def tie_stages(ties: list[Tie], plan: Plan, stage: int, module: StageModule) -> list[Any]:
    """Make each tie's group (every replica of its stages; every rank takes part, in
    order), start this stage's copy from the first stage's value and have its updates sum
    the gradients over the group, each stage's once; the groups made."""
    made: list[Any] = []
    for tie in ties:
        ranks = [r for s in tie.stages for r in plan.stages[s].ranks]
        group = dist.new_group(ranks)
        made.append(group)
        if stage in tie.stages:
            index = module.module_param_names.index(tie.names[tie.stages.index(stage)])
            module.tie(index, group, counts=dist.get_rank() == plan.stages[stage].ranks[0],
                       src=ranks[0])
    return made

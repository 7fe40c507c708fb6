"""Weights tied across stages: each stage holds a copy, and the copies stay equal.

A parameter shared by layers of several stages (GPT-2's input embedding and output head,
tied by ``tie_weights``) lives on each of those stages, as DeepSpeed's ``TiedLayerSpec``
does. The first stage's value is broadcast to the others as the stages are built, before
any 16-bit cast (a model built on ``meta`` initialises each copy on its own), and every
update first sums the copies' gradients, each stage's once
(:mod:`~dreampipe.runtime.stage_ties`): the copies a rank holds (two of its virtual
stages may), then over the ranks. So each copy applies the same change, the global norm
of ``max_grad_norm`` counts the weight once, and training equals one process. Each stage
stashes its copy with its own weight versions; the state dict has the parameter under
every stage's name, with one value.

A tied stage may be replicated: its replicas' gradients are summed first (its
``ALLREDUCE``, which the update pass puts before the rank's first ``STEP`` of the
update, also on copies of an interleaved or V pipeline), so only its first replica adds
its sum to the tie's, the others add zeros, and every copy takes the same total. Ties
are honoured on any schedule, but not on a stage split over workers, nor under pipedream
on stages replicated unequally (they update at different rates, so no update has every
copy's gradient to sum): a ConfigError before training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from dreampipe.errors import ConfigError
from dreampipe.planning.plan import Plan
from dreampipe.runtime.lanes import Routes
from dreampipe.runtime.stage_module import StageModule
from dreampipe.runtime.stage_ties import RankTie, TiedCopy, start_values
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.agreement import check_agreement
from dreampipe.splitter.chain import Tie

__all__ = ["HeldTies", "TiePlace", "check_tie_groups", "check_ties", "tie_place", "tie_places"]


def check_ties(ties: list[Tie], plan: Plan, kind: ScheduleKind = ScheduleKind.GPIPE) -> None:
    """The ties must be ones the Pipeline can keep equal under ``kind`` (see the module
    docstring)."""
    for tie in ties:
        check_agreement(kind, [plan.stages[s].replicas for s in tie.stages],
                        f"parameter {tie.names[0]!r} tied to "
                        f"{', '.join(map(repr, tie.names[1:]))} on stages "
                        f"{', '.join(map(str, tie.stages))}", "plan")
        if plan.has_splits:
            raise ConfigError(
                f"parameter {tie.names[0]!r} is tied to {', '.join(map(repr, tie.names[1:]))} "
                f"on stages {', '.join(map(str, tie.stages))}, which plan {plan.config} splits "
                "over workers; a tied weight is kept on stages with no split: use such a plan, "
                "or split points that put the tied layers on one stage with no split", "plan")


def check_tie_groups(ties: Sequence[Tie], modules: Sequence[StageModule]) -> None:
    """Every copy of a tied weight must train with the same optimizer settings, as the one
    tensor does in one process; a factory that picks groups by name may put a copy, named
    as its stage holds it (``lm_head.weight``), in another group than the first (no
    weight decay on ``embed``): the copies would drift apart. A ConfigError on every rank
    naming both names (a collective over the world: every rank calls it)."""
    if not ties:
        return
    by_stage = {m.stage: m for m in modules}
    mine = {(k, name): _group_settings(by_stage[s], name)
            for k, tie in enumerate(ties) for s, name in zip(tie.stages, tie.names, strict=True)
            if s in by_stage}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    named: dict[int, dict[str, Any]] = {}
    for part in gathered:
        for (k, name), settings in part.items():
            named.setdefault(k, {})[name] = settings
    for k in sorted(named):
        known = [(n, v) for n, v in named[k].items() if v is not None]
        if not known:
            continue
        (first, want), *rest = known
        for name, got in rest:
            if got != want:
                apart = sorted(key for key in {*want, *got} if want.get(key) != got.get(key))
                raise ConfigError(
                    f"parameter {first!r} is tied to {name!r}, and the optimizer factory "
                    f"puts the two in groups that differ in {', '.join(apart)} "
                    f"({', '.join(f'{k}={want.get(k)!r} against {got.get(k)!r}' for k in apart)})"
                    ": the copies would drift apart; give every name of a tied weight the "
                    "same group (one process steps it once, in its first name's)", "optimizer")


def _group_settings(module: StageModule, name: str) -> dict[str, Any] | None:
    """The settings of the optimizer group stepping ``module``'s parameter ``name`` (None:
    no group holds it as the stage steps it)."""
    opt = module.optimizer
    stepped = module.optimized[module.module_param_names.index(name)]
    group = next((g for g in opt.param_groups if any(p is stepped for p in g["params"])),
                 None) if opt is not None else None
    if group is None:
        return None
    return {k: (float(v.item()) if v.numel() == 1 else v.tolist()) if isinstance(v, Tensor)
            else v for k, v in group.items() if k != "params"}


@dataclass(frozen=True)
class TiePlace:
    """Where a tie's copies are, as rank ``rank`` sees them."""

    #: Every rank holding a copy (each replica of each stage), in order: the tie's group.
    ranks: tuple[int, ...]
    #: The rank whose copy every copy starts from: the first stage's first replica.
    src: int
    #: This rank's copies, in stage order: ``(stage, name, counts, normed)``, where
    #: ``counts``: the rank is its stage's first replica, which adds the stage's gradient;
    #: ``normed``: the stage is the tie's first, where the global norm counts the weight.
    copies: tuple[tuple[int, str, bool, bool], ...]


def tie_place(tie: Tie, plan: Plan, rank: int) -> TiePlace:
    """Where ``tie``'s copies are on ``plan``'s ranks, as ``rank`` sees them."""
    ranks = sorted({r for s in tie.stages for r in plan.stages[s].ranks})
    copies = tuple((s, name, plan.stages[s].ranks[0] == rank, s == tie.stages[0])
                   for s, name in zip(tie.stages, tie.names, strict=True)
                   if rank in plan.stages[s].ranks)
    return TiePlace(tuple(ranks), plan.stages[tie.stages[0]].ranks[0], copies)


@dataclass(frozen=True)
class HeldTies:
    """The ties a rank holds copies of, each with its place and group (None: held on this
    rank alone), and every group made for them (each rank makes them all, in order)."""

    held: tuple[tuple[TiePlace, Any], ...]
    made: tuple[Any, ...]

    def start(self, built: Mapping[int, nn.Module]) -> None:
        """Start every copy on the rank's ``built`` stages (by stage, as built: before
        their optimizers cast or shard them) from the first stage's value."""
        start_values([([built[s].get_parameter(name) for s, name, _, _ in place.copies],
                        group, place.src) for place, group in self.held])

    def ranks(self, modules: Sequence[StageModule]) -> list[RankTie]:
        """The ties as the rank's stage ``modules`` hold them, for the runtime's sums."""
        by_stage = {m.stage: m for m in modules}
        return [RankTie(tuple(TiedCopy(m, m.module_param_names.index(name), counts, normed)
                              for s, name, counts, normed in place.copies
                              for m in (by_stage[s],)), group, place.src)
                for place, group in self.held]


def tie_places(ties: list[Tie], plan: Plan, routes: Routes) -> HeldTies:
    """Where ``ties``' copies are on this rank of ``plan`` (schedule rank ``routes.rank``),
    with a group for each tie held on more than one rank (every rank makes them, in
    order). A tie's stages are not split, so its ranks' processes are their first
    workers: the place's ranks and source are process ranks."""
    held: list[tuple[TiePlace, Any]] = []
    made: list[Any] = []
    for tie in ties:
        at = tie_place(tie, plan, routes.rank)
        place = dataclasses.replace(at, ranks=tuple(sorted(routes.first(r) for r in at.ranks)),
                                    src=routes.first(at.src))
        group = dist.new_group(list(place.ranks)) if len(place.ranks) > 1 else None
        if group is not None:
            made.append(group)
        if place.copies:
            held.append((place, group))
    return HeldTies(tuple(held), tuple(made))

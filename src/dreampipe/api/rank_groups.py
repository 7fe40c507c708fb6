"""The process groups a rank of a :class:`~dreampipe.api.pipeline.Pipeline` talks on.

Schedule rank ``r`` runs on the process ranks the plan lays it on
(:func:`~dreampipe.planning.placement.rank_workers`): in rank order, unless the plan's
stages name other workers, as a plan that copies one server's stages onto every
server does; so a run takes the links its plan was priced on (docs/design.md §4.6).
Ranks in order with one split width talk on lanes; a plan that mixes widths or lays its
ranks out of order talks on routes over world groups (docs/design.md §10.4). Every rank
makes every group, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dreampipe.planning.placement import moved_stages
from dreampipe.planning.plan import Plan
from dreampipe.runtime.lanes import Links, Routes, process_groups, routed_groups, split_mesh
from dreampipe.runtime.tensor_split import tensor_mesh

__all__ = ["RankGroups", "end_groups", "rank_groups"]


@dataclass(frozen=True)
class RankGroups:
    """Where a process runs in the plan, and the groups it talks on."""

    #: Its schedule rank and place among that rank's workers.
    routes: Routes
    #: The mesh of its split replica; None where its stage is not split.
    mesh: DeviceMesh | None
    #: The groups activations and gradients travel on.
    links: Links
    #: Each replicated stage's gradient all-reduce group this process is in, by stage.
    stage_groups: dict[int, Any]
    #: Every worker, for the global gradient norm (None: no clipping).
    clip_group: Any
    #: Every group made here, for whoever destroys them (meshes' own groups aside).
    made: tuple[Any, ...]


def rank_groups(plan: Plan, worker: int, device_type: str, *, clip: bool) -> RankGroups:
    """The groups process rank ``worker`` of a run of ``plan`` talks on (a collective)."""
    routes = Routes.of(plan, worker)
    widths = {st.tensor_parallel for st in plan.stages}
    t, world = max(widths), plan.workers_used
    made: list[Any] = []
    if len(widths) > 1 or moved_stages(plan):
        mesh = split_mesh(plan, worker, device_type, made=made)
        links, groups = routed_groups(plan, worker, made=made)
    else:
        mesh = tensor_mesh(world, t, device_type) if t > 1 else None
        links, groups = process_groups([st.ranks for st in plan.stages], t, made=made)
    clip_group = dist.new_group(list(range(world))) if clip else None
    if clip_group is not None:
        made.append(clip_group)
    return RankGroups(routes, mesh, links, groups, clip_group, tuple(made))


def end_groups(groups: list[Any]) -> None:
    """Destroy the ``groups`` this process is in (those :func:`rank_groups` made, and the
    ties')."""
    for group in groups:
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)

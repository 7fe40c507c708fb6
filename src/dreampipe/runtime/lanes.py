"""Which workers talk to which: lanes for one split width, routes for plans that mix them.

The schedule names one rank per replica of a stage (a *schedule rank*); a
stage split over ``t`` workers runs each of its schedule ranks on ``t``
adjacent workers, where the plan lays them
(:func:`~dreampipe.planning.placement.rank_workers`; in rank order unless its
stages say other workers). With one split width and ranks in order, worker
``k`` of every schedule rank talks to worker ``k`` of its peers, on the groups
of lane ``k``. In a plan that mixes widths (``"1t2-2"``) or lays ranks out of
order, receiving worker ``k`` takes the tensor from sending worker ``k mod
ts``, on two world groups (docs/design.md §10.4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dreampipe.planning.placement import rank_workers
from dreampipe.planning.plan import Plan

__all__ = ["Links", "Routes", "process_groups", "routed_groups", "split_mesh"]


@dataclass(frozen=True)
class Routes:
    """The workers behind each schedule rank (``widths``, from ``firsts``), and this
    worker's place: schedule rank ``rank``, worker ``member`` of its ``widths[rank]``."""

    widths: tuple[int, ...]
    rank: int
    member: int
    firsts: tuple[int, ...]

    @classmethod
    def of(cls, plan: Plan, worker: int) -> Routes:
        """Worker ``worker``'s routes in ``plan``, its ranks where the plan lays them."""
        placed = rank_workers(plan)
        firsts, widths = (tuple(x) for x in zip(*placed, strict=True))
        for rank, (first, width) in enumerate(placed):
            if first <= worker < first + width:
                return cls(widths, rank, worker - first, firsts)
        raise ValueError(f"worker {worker} is not in plan {plan.config}")

    def first(self, rank: int) -> int:
        """The first worker of schedule rank ``rank``."""
        return self.firsts[rank]

    def source(self, peer: int) -> int:
        """The worker of schedule rank ``peer`` this worker receives from."""
        return self.first(peer) + self.member % self.widths[peer]

    def targets(self, peer: int) -> tuple[int, ...]:
        """The workers of schedule rank ``peer`` this worker sends to (maybe none)."""
        mine = self.widths[self.rank]
        return tuple(self.first(peer) + k for k in range(self.widths[peer])
                     if k % mine == self.member)


class Links(NamedTuple):
    """The groups activations and gradients travel on, and how schedule ranks map to
    their ranks: ``routes`` None for a lane (group rank = schedule rank)."""

    fwd: Any
    bwd: Any
    routes: Routes | None = None


def process_groups(
    stage_ranks: Sequence[Sequence[int]], tensor_parallel: int = 1, *,
    made: list[Any] | None = None,
) -> tuple[Links, dict[int, Any]]:
    """The lane groups of a run whose stages are all split over ``tensor_parallel``
    workers; every rank creates them, in this order, and adds each to ``made`` (for
    whoever destroys them).

    Returns this worker's lane's two link groups (activations, gradients) and
    one group per replicated stage (its gradient all-reduce). Peers are named
    by schedule rank, which is their rank in these groups: worker ``k`` of
    every replica talks on lane ``k``, the workers ``r * t + k`` of every
    schedule rank ``r``.
    """
    ranks = len({r for rs in stage_ranks for r in rs})  # a rank may run several stages
    mine = dist.get_rank() % tensor_parallel
    out: tuple[Links, dict[int, Any]] = (Links(None, None), {})
    for lane in range(tensor_parallel):
        def world(rs: Sequence[int], k: int = lane) -> list[int]:
            return [r * tensor_parallel + k for r in rs]

        links = Links(dist.new_group(world(range(ranks))), dist.new_group(world(range(ranks))))
        groups = {s: dist.new_group(world(r)) for s, r in enumerate(stage_ranks) if len(r) > 1}
        if made is not None:
            made += [links.fwd, links.bwd, *groups.values()]
        if lane == mine:
            out = (links, groups)
    return out


def routed_groups(plan: Plan, worker: int, *, made: list[Any] | None = None
                  ) -> tuple[Links, dict[int, Any]]:
    """The groups of a run of ``plan`` whose stages mix split widths or sit out of rank
    order (docs/design.md §10.4): two world link groups with ``worker``'s routes, and per
    replicated stage the all-reduce group of ``worker``'s place. Every rank creates all,
    in this order."""
    routes = Routes.of(plan, worker)
    world = list(range(plan.workers_used))
    links = Links(dist.new_group(world), dist.new_group(world), routes)
    made_here = [links.fwd, links.bwd]
    groups = {}
    for s, st in enumerate(plan.stages):
        if st.replicas == 1:
            continue
        for k in range(st.tensor_parallel):
            group = dist.new_group([routes.first(r) + k for r in st.ranks])
            made_here.append(group)
            if routes.rank in st.ranks and routes.member == k:
                groups[s] = group
    if made is not None:
        made += made_here
    return links, groups


def split_mesh(plan: Plan, worker: int, device_type: str, *, made: list[Any] | None = None
               ) -> DeviceMesh | None:
    """The 1-D mesh of ``worker``'s split replica in a plan that mixes widths, None for an
    unsplit worker; every rank creates a group per split replica, in order."""
    routes = Routes.of(plan, worker)
    mesh = None
    for rank, width in enumerate(routes.widths):
        if width == 1:
            continue
        first = routes.first(rank)
        group = dist.new_group(list(range(first, first + width)))
        if made is not None:
            made.append(group)
        if rank == routes.rank:
            mesh = DeviceMesh.from_group(group, device_type)
    return mesh

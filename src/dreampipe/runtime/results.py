"""What one rank measured, and the pieces rank 0 builds a run's result from once gathered."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from dreampipe.runtime.backend import group_device
from dreampipe.scheduling.events import Event

if TYPE_CHECKING:
    from dreampipe.runtime.memory_meter import MemoryUse

__all__ = ["RankReport", "gather_on_first", "sorted_events", "stage_states"]


@dataclass
class RankReport:
    """One rank's loop seconds, events, final state and memory; gathered on rank 0."""

    rank: int
    stage: int
    replica: int
    loop_s: float
    events: list[Event] = field(default_factory=list)
    state: dict[str, Tensor] | None = None
    memory: MemoryUse | None = None


def stage_states(reports: list[RankReport], num_stages: int) -> list[dict[str, Tensor]]:
    """Each stage's final ``state_dict``, from the report of its replica 0."""
    states: list[dict[str, Tensor]] = [{} for _ in range(num_stages)]
    for rep in reports:
        if rep.replica == 0 and rep.state is not None:
            states[rep.stage] = rep.state
    return states


def sorted_events(reports: list[RankReport]) -> tuple[Event, ...]:
    """Every rank's events on the one time line, in start order."""
    return tuple(sorted((e for rep in reports for e in rep.events),
                        key=lambda e: (e.start_s, e.rank)))


def gather_on_first(mine: Any) -> list[Any] | None:
    """Every rank's ``mine`` on rank 0, in rank order (None on the others), each rank's
    pickled bytes sent at their own size.

    ``dist.gather_object`` pads every rank's bytes to the largest, so ranks holding no
    state would send as many bytes as the one holding the largest stage's: seconds of
    zeros over a slow link between nodes, at the end of every run.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = group_device()
    data = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    if rank != 0:
        dist.send(data, 0)
        return None
    gathered = [mine]
    for src in range(1, world):
        buf = torch.empty(int(sizes[src].item()), dtype=torch.uint8, device=device)
        dist.recv(buf, src)
        gathered.append(pickle.loads(buf.cpu().numpy().tobytes()))
    return gathered

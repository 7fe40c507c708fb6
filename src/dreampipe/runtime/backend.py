"""The backend a node's ranks train and measure with: NCCL where every one has a GPU.

NCCL refuses two ranks on one GPU, so a node with fewer GPUs than ranks runs
them all on the CPU with gloo, one thread each (the cores are shared out
among the ranks); with a GPU per rank, rank ``LOCAL_RANK`` uses
``cuda:LOCAL_RANK`` and torch's own thread count.
"""

from __future__ import annotations

import os
from enum import Enum

import torch
import torch.distributed as dist

from dreampipe.errors import ConfigError

__all__ = ["Backend", "backend_for_node", "barrier", "check_measurable", "gpus_here",
           "group_device"]


class Backend(Enum):
    """The ``torch.distributed`` backend of a group."""

    NCCL = "nccl"
    GLOO = "gloo"

    @property
    def threads(self) -> int | None:
        """Threads per rank: torch's default beside a GPU, one on a shared CPU."""
        return None if self is Backend.NCCL else 1


def gpus_here() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def group_device() -> torch.device:
    """Where the default group's collectives take their tensors: this rank's GPU under
    NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for_node(local_ranks: int) -> Backend:
    """NCCL where each of ``local_ranks`` ranks on this node has a GPU of its own, else gloo."""
    gpus = gpus_here()
    return Backend.NCCL if gpus and gpus >= local_ranks else Backend.GLOO


def check_measurable(workers: int) -> None:
    """Refuse to measure links between more local workers than this node runs apart: past
    its GPUs (2 or more: one GPU has no link to measure, and its workers measure the
    CPU's) they would fall back to gloo on the CPU and measure the CPU's links for the
    GPUs'; past its cores (at least 2) they time-share and measure their own contention."""
    gpus = gpus_here()
    most, what, why = ((gpus, "GPUs", "workers beyond them would be measured over gloo on the "
                        "CPU, not between the GPUs") if gpus >= 2 else
                       (max(2, os.cpu_count() or 1), "cores", "more processes than cores "
                        "measure their own contention, not the links"))
    if workers > most:
        raise ConfigError(f"workers={workers}: this machine has {most} {what}, and {why}; "
                          f"give workers={most} or fewer", "workers")


def barrier(timeout_s: float) -> None:
    """A barrier with a deadline where the backend has one (gloo)."""
    from datetime import timedelta

    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        dist.barrier()

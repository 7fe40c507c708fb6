"""The backend a node's ranks train and measure with: NCCL where every one has a GPU.

NCCL refuses two ranks on one GPU, so a node with fewer GPUs than ranks runs
them all on the CPU with gloo, one thread each (the cores are shared out
among the ranks); with a GPU per rank, rank ``LOCAL_RANK`` uses
``cuda:LOCAL_RANK`` and torch's own thread count.
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.distributed as dist

__all__ = ["Backend", "backend_for_node", "barrier", "gpus_here"]


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


def backend_for_node(local_ranks: int) -> Backend:
    """NCCL where each of ``local_ranks`` ranks on this node has a GPU of its own, else gloo."""
    gpus = gpus_here()
    return Backend.NCCL if gpus and gpus >= local_ranks else Backend.GLOO


def barrier(timeout_s: float) -> None:
    """A barrier with a deadline where the backend has one (gloo)."""
    from datetime import timedelta

    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        dist.barrier()

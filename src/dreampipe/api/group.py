"""Joining the process group a ``Pipeline`` trains in, and the rank's device.

Under ``torchrun`` a rank joins its group through the environment (with the
agent's store per restart attempt); a script run alone makes a group of one,
so the same code trains on one process or many. The backend is NCCL when
this node has a GPU for every local rank (rank ``LOCAL_RANK`` on
``cuda:LOCAL_RANK``), else gloo on the CPU: two ranks never share a GPU,
which NCCL refuses.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dreampipe.runtime.backend import Backend, backend_for_node, gpus_here

__all__ = ["init_process_group", "rank_device"]

_log = logging.getLogger(__name__)


def _backend(local_ranks: int) -> str:
    """:func:`~dreampipe.runtime.backend.backend_for_node`, saying so when GPUs go unused."""
    backend, gpus = backend_for_node(local_ranks), gpus_here()
    if backend is Backend.GLOO and gpus:
        _log.warning("%d ranks on this node but %d GPU(s): training on the CPU with gloo; "
                     "start at most %d ranks a node (torchrun --nproc-per-node) to use them",
                     local_ranks, gpus, gpus)
    return backend.value


def init_process_group(timeout_s: float) -> bool:
    """Join torchrun's group (env://), or make a group of one; True if this started one."""
    if dist.is_initialized():
        return False
    timeout = timedelta(seconds=max(timeout_s, 60.0))
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        backend = _backend(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        dist.init_process_group(backend, timeout=timeout, **_attempt_store(timeout),
                                **_bound(backend))
    else:
        store = dist.HashStore()  # type: ignore[attr-defined]
        backend = _backend(1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1,
                                timeout=timeout, **_bound(backend))
    return True


def _bound(backend: str) -> dict[str, Any]:
    """Under NCCL, the rank's GPU named to the group, so its collectives (barrier
    included) never guess the device."""
    if backend != Backend.NCCL.value:
        return {}
    return {"device_id": torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))}


def _attempt_store(timeout: timedelta) -> dict[str, Any]:
    """Under torchrun, its agent's store seen under a prefix of this attempt (restart count).

    torchrun's static rendezvous (``--master-addr``/``--master-port``) keeps one
    store across restarts: without the prefix a restarted group would read the
    addresses of the ranks it replaced and fail to connect.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timeout,
    )
    prefix = f"dreampipe/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    mine = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
    return {"store": mine, "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def rank_device() -> torch.device:
    """This rank's device: CUDA device ``LOCAL_RANK`` under NCCL (made current), else the CPU."""
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")

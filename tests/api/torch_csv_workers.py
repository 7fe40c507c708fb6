"""Schedules exchanged with PyTorch's pipelining, run on both sides in one launch.

:func:`run_both` trains a PyTorch-written schedule in dreampipe's Pipeline
(:func:`schedule_workers.train_schedule` with ``schedule_file``) and runs one step of a
dreampipe-written schedule in PyTorch's own ``_PipelineScheduleRuntime``;
:func:`torch_reference` is that step in one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dreampipe.api.group import init_process_group
from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset

from .schedule_workers import train_schedule

__all__ = ["run_both", "torch_reference"]


def run_both(rank: int, world: int, jobs: dict[str, Any]) -> dict[str, Any]:
    """``jobs["torch"]`` through PyTorch's runtime, then every other job through the
    Pipeline, in one process group."""
    init_process_group(30.0)
    try:
        mine = _torch_step(rank, world, jobs["torch"])
        return {"torch": mine, **{name: train_schedule(rank, world, job)
                                  for name, job in jobs.items() if name != "torch"}}
    finally:
        dist.destroy_process_group()


def _torch_step(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """One step of ``job["path"]`` (compute_comms) with SGD; this rank's stage's state."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    spec = get_model(job["model"], **job["model_args"])
    data = load_dataset("synthetic", spec, seed=job["seed"])
    bounds = [*job["bounds"], spec.num_layers]
    module = spec.build(bounds[rank], bounds[rank + 1] - 1, job["seed"])
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = _PipelineScheduleRuntime([stage], job["microbatches"], loss_fn=spec.loss_fn)
    schedule._load_csv(job["path"], format="compute_comms")
    optimizer = torch.optim.SGD(module.parameters(), lr=job["lr"])
    x, y = data.batch(0, job["minibatch"])
    losses: list[Tensor] = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    optimizer.step()
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "losses": [float(v) for v in losses]}


def torch_reference(job: dict[str, Any]) -> tuple[list[float], dict[str, Tensor]]:
    """The step in one process: each microbatch's mean loss over the microbatches,
    accumulated (PyTorch's ``scale_grads``), one SGD step."""
    spec = get_model(job["model"], **job["model_args"])
    data = load_dataset("synthetic", spec, seed=job["seed"])
    model = spec.build(0, spec.num_layers - 1, job["seed"])
    optimizer = torch.optim.SGD(model.parameters(), lr=job["lr"])
    micro = job["microbatches"]
    x, y = data.batch(0, job["minibatch"])
    size = job["minibatch"] // micro
    losses = []
    for m in range(micro):
        loss = spec.loss_fn(model(x[m * size:(m + 1) * size]), y[m * size:(m + 1) * size])
        (loss / micro).backward()
        losses.append(float(loss.detach()))
    optimizer.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

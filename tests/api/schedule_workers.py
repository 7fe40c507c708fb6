"""A rank function and its single-process reference for the newer synchronous schedules
(zero-bubble, interleaved): a zoo model, a user optimizer, clipping."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dreampipe.api import Pipeline, TrainConfig
from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset
from dreampipe.models.spec import ModelSpec
from dreampipe.planning.placement import Placement
from dreampipe.planning.plan import Plan

__all__ = ["reference", "train_schedule"]


def _spec(job: dict[str, Any]) -> ModelSpec:
    return get_model(job["model"], **job["model_args"])


def _optimizer(job: dict[str, Any]) -> Any:
    if job["optimizer"] == "adamw":
        return lambda p: torch.optim.AdamW(p, lr=job["lr"], weight_decay=0.1)
    return lambda p: torch.optim.SGD(p, lr=job["lr"], momentum=0.9)


def train_schedule(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any] | None:
    """Train ``job["model"]`` through the Pipeline; rank 0 reports losses and state.

    ``job``: model, model_args, schedule, bounds, replicas, virtual_stages (and their
    placement, ``"loop"`` by default, or ``"v"``), steps, minibatch, microbatches,
    optimizer (``sgd`` with momentum or ``adamw``), lr, clip (None or a norm), seed, and
    optionally schedule_file.
    """
    spec = _spec(job)
    data = load_dataset("synthetic", spec, seed=job["seed"])
    plan = Plan.from_config(spec.num_layers, job["bounds"], job["replicas"],
                            virtual_stages=job.get("virtual_stages", 1),
                            placement=Placement(job.get("placement", "loop")))
    extra: dict[str, Any] = {"virtual_stages": job["virtual_stages"]} if job.get(
        "virtual_stages", 1) > 1 else {}
    if "schedule_file" in job:
        extra["schedule_file"] = job["schedule_file"]
    pipe = Pipeline(
        spec.build(0, spec.num_layers - 1, job["seed"]),
        example=data.batch(0, job["minibatch"]), loss_fn=spec.loss_fn,
        optimizer=_optimizer(job), plan=plan,
        config=TrainConfig(schedule=job["schedule"], microbatches=job["microbatches"],
                           max_grad_norm=job["clip"], timeout_s=30.0, **extra),
    )
    for k in range(job["steps"]):
        pipe.step(*data.batch(k, job["minibatch"]))
    losses = pipe.finish()
    state = pipe.full_state_dict()
    pipe.close()
    return {"losses": losses, "state": state} if rank == 0 else None


def reference(job: dict[str, Any]) -> tuple[list[float], dict[str, Tensor]]:
    """One process: per minibatch, the microbatches' mean losses accumulated, the
    gradient clipped by its global norm, one optimizer step."""
    spec = _spec(job)
    data = load_dataset("synthetic", spec, seed=job["seed"])
    model: nn.Module = spec.build(0, spec.num_layers - 1, job["seed"])
    opt = _optimizer(job)(list(model.parameters()))
    micro = job["microbatches"]
    size = job["minibatch"] // micro
    losses = []
    for k in range(job["steps"]):
        x, y = data.batch(k, job["minibatch"])
        opt.zero_grad()
        total = 0.0
        for m in range(micro):
            loss = spec.loss_fn(model(x[m * size:(m + 1) * size]), y[m * size:(m + 1) * size])
            (loss / micro).backward()
            total += float(loss.detach())
        if job["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), job["clip"])
        opt.step()
        losses.append(total / micro)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

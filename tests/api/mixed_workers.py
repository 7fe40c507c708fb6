"""A rank function that trains the mlp zoo model through a Pipeline on a plan that mixes
split, unsplit, replicated and recomputing stages, measuring its peak memory."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dreampipe.api import Pipeline, TrainConfig
from dreampipe.api.group import init_process_group
from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset
from dreampipe.runtime.memory_meter import start_measuring

__all__ = ["train_mixed"]


def train_mixed(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Train ``job["kwargs"]``'s mlp on ``job["plan"]`` for ``steps`` minibatches of
    ``minibatch`` (``microbatches`` each) under ``schedule``, with SGD at ``lr``.

    Like ``dreampipe train --measure-memory``: the meter starts before the model exists,
    built on meta, and counts the Pipeline's work to the drained pipeline's peak. Every
    rank returns its stage, whether it recomputes, its memory use in bytes, the
    checkpoint it saved in ``job["save"]`` (if given), the mean loss of
    ``job["evaluate"]`` held-out minibatches, and rank 0 the losses and the whole state."""
    spec = get_model("mlp", **job["kwargs"])
    data = load_dataset("synthetic", spec, seed=0)
    init_process_group(60.0)
    meter = start_measuring(torch.device("cpu"))
    with torch.device("meta"):
        model = spec.build(seed=0)
    lr = job["lr"]
    pipe = Pipeline(model, example=data.batch(0, job["minibatch"]), loss_fn=spec.loss_fn,
                    optimizer=lambda p: torch.optim.SGD(p, lr=lr), plan=job["plan"],
                    config=TrainConfig(schedule=job["schedule"], microbatches=job["microbatches"],
                                       timeout_s=60.0, measure_memory=True))
    for k in range(job["steps"]):
        pipe.step(*data.batch(k, job["minibatch"]))
    losses = pipe.finish()
    used = meter.finish(rank, pipe.module.stage).used
    saved = str(pipe.save(job["save"])) if "save" in job else None
    held_out = [data.batch(100 + j, job["minibatch"]) for j in range(job.get("evaluate", 0))]
    evaluated = pipe.evaluate(held_out).loss if held_out else None
    state = pipe.full_state_dict()
    out = {"stage": pipe.module.stage, "recomputes": pipe.module.recompute, "used": used,
           "saved": saved, "evaluated": evaluated,
           "losses": losses if rank == 0 else None, "state": state if rank == 0 else None}
    pipe.close()
    dist.destroy_process_group()
    return out

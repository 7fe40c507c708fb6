"""Rank functions for the Pipeline tests, run by the runtime's launcher (one process each)."""

from __future__ import annotations

from typing import Any

import torch

from dreampipe.api import Pipeline, TrainConfig
from dreampipe.api import pipeline as pipeline_module
from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset
from dreampipe.planning.plan import Plan
from dreampipe.runtime.comm import Comm
from dreampipe.scheduling.actions import ActionKind

__all__ = ["train_zoo"]


def train_zoo(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any] | None:
    """Train the zoo's mlp through the Pipeline on the synthetic stream; rank 0 reports.

    ``job``: bounds, replicas, schedule, steps, minibatch, microbatches, lr,
    momentum, seed; optional ``plan`` (a Plan instead of bounds and replicas),
    ``virtual_stages``, ``optimizer`` ("adamw"; SGD by default), ``gamma`` (an
    exponential learning-rate decay per update), ``compensate``
    (staleness compensation, on by default), ``save``
    (a directory) and ``resume``,
    ``segment_microbatches`` (the Pipeline's segment cap), ``finish_every`` (call
    ``finish()`` every that many steps) and ``finish_after`` (after those numbers of
    steps), ``record_events``, ``evaluate`` (so
    many held-out batches after every ``finish()``), ``post_ahead`` (False:
    post no receive ahead, as on NCCL). Rank 0 also reports the most microbatches its
    schedule ever held, and the numbers of its ``STEP`` events; the last rank
    reports, after each step, whether the next minibatch's receive is posted, and
    ``hyper``, its optimizer's settings as the run began (after any resume).
    """
    if "segment_microbatches" in job:
        pipeline_module.SEGMENT_MICROBATCHES = job["segment_microbatches"]
    if not job.get("post_ahead", True):
        Comm.posts_ahead = property(lambda self: False)  # type: ignore[method-assign,assignment]
    spec = get_model("mlp", layers=4, width=16)
    data = load_dataset("synthetic", spec, seed=job["seed"])
    plan = job.get("plan") or Plan.from_config(spec.num_layers, job["bounds"], job["replicas"],
                                               virtual_stages=job.get("virtual_stages", 1))
    lr, momentum = job["lr"], job.get("momentum", 0.0)

    def optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if job.get("optimizer") == "adamw":
            return torch.optim.AdamW(params, lr=lr)
        return torch.optim.SGD(params, lr=lr, momentum=momentum)

    pipe = Pipeline(
        spec.build(0, spec.num_layers - 1, job["seed"]),
        example=data.batch(0, job["minibatch"]), loss_fn=spec.loss_fn,
        optimizer=optimizer, plan=plan,
        lr_scheduler=(lambda o: torch.optim.lr_scheduler.ExponentialLR(o, job["gamma"]))
        if "gamma" in job else (lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=lr, total_steps=job["one_cycle"])) if "one_cycle" in job else None,
        config=TrainConfig(
            schedule=job["schedule"], virtual_stages=job.get("virtual_stages", 1),
            compensate=job.get("compensate", True), microbatches=job.get("microbatches", 1),
            vertical_sync=job.get("vertical_sync", False), resume=job.get("resume"),
            record_events=job.get("record_events", False), timeout_s=30.0,
            precision=job.get("precision", "fp32"), zero=job.get("zero", 0)),
    )
    loaded = pipe.full_state_dict() if "resume" in job else None
    opt = pipe.module.optimizer
    hyper = [{k: g[k] for k in ("lr", "momentum", "betas") if k in g}
             for g in (opt.param_groups if opt is not None else [])]
    start = pipe.minibatches
    losses: list[float] = []
    evals: list[float] = []
    ahead: list[bool] = []
    longest = 0
    held_out = [data.batch(10_000 + j, job["minibatch"]) for j in range(job.get("evaluate", 0))]
    for k in range(start, start + job["steps"]):
        pipe.step(*data.batch(k, job["minibatch"]))
        longest = max(longest, pipe.runner.schedule.num_microbatches)
        ahead.append((ActionKind.RECV_F, k + 1) in pipe.runner.comm.pending_receives)
        done = k + 1 - start
        if done % job.get("finish_every", job["steps"] + 1) == 0 or done in job.get(
                "finish_after", ()):
            losses += pipe.finish()
            if held_out:
                evals.append(pipe.evaluate(held_out).loss)
    losses += pipe.finish()
    saved = str(pipe.save(job["save"])) if "save" in job else None
    state = pipe.full_state_dict()
    pipe.close()
    out = {"losses": losses, "state": state, "saved": saved, "loaded": loaded, "hyper": hyper,
           "longest": longest, "evals": evals,
           "updates": [e.microbatch for e in pipe.events if e.kind is ActionKind.STEP]}
    if rank == 0:
        return out
    return {"ahead": ahead} if rank == world - 1 else None

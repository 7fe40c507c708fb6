"""Entry point for the torchrun test: train a tiny pipeline, print the result on rank 0."""

from __future__ import annotations

import json

import torch

from dreampipe.planning.plan import Plan
from dreampipe.runtime import RunConfig, run_from_env
from dreampipe.scheduling.actions import ScheduleKind

__all__: list[str] = []

if __name__ == "__main__":
    torch.set_num_threads(1)
    cfg = RunConfig(
        model="mlp", model_kwargs=(("layers", 4), ("width", 16)),
        plan=Plan.from_config(4, [0, 2], [1, 1]), schedule=ScheduleKind.FLUSH,
        minibatch_size=16, microbatches=4, steps=3, seed=3, lr=0.2, timeout_s=30.0,
    )
    result = run_from_env(cfg)
    if result is not None:
        print(json.dumps({"losses": list(result.losses)}))

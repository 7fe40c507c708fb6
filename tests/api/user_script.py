"""A training script written only against dreampipe's public API (run under torchrun).

Its own ``nn.Sequential`` with LayerNorm and GELU, its own data iterator,
AdamW with a LambdaLR warm-up. ``python -m torch.distributed.run
--nproc-per-node 2 user_script.py SCHEDULE OUT [--straight]`` trains 12
minibatches; rank 0 prints the losses as JSON and saves the final weights to OUT.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dreampipe

__all__ = ["STEPS", "batches", "build_model", "main", "optimizer", "warmup"]

STEPS, BATCH, MICRO = 12, 16, 2


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 32), nn.LayerNorm(32), nn.GELU(),
        nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 3),
    )


def batches(n: int) -> Iterator[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(12, 3, generator=gen)
    for _ in range(n):
        x = torch.randn(BATCH, 12, generator=gen)
        yield x, (x @ w).argmax(1)


def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-2, weight_decay=0.01)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def main() -> None:
    schedule, out = sys.argv[1], sys.argv[2]
    plan: dreampipe.Plan | str = "auto"
    if "--straight" in sys.argv:
        plan = dreampipe.Plan.from_config(7, [0, 3], [1, 1])
    pipe = dreampipe.Pipeline(
        build_model(), example=next(batches(1)), loss_fn=F.cross_entropy, optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup),
        plan=plan, config=dreampipe.TrainConfig(
            schedule=schedule, microbatches=1 if schedule == "pipedream" else MICRO),
    )
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else STEPS
    for x, y in batches(steps):
        pipe.step(x, y)
    losses = pipe.finish()
    state = pipe.full_state_dict()
    if torch.distributed.get_rank() == 0:
        torch.save(state, out)
        print(json.dumps({"losses": losses, "plan": pipe.plan.config}))
    pipe.close()


if __name__ == "__main__":
    main()

"""The digits CNN written against ``dreampipe.Pipeline`` with a plain ``DataLoader``.

    torchrun --nproc-per-node 2 examples/digits_cnn.py    # PipeDream, the planner's plan
    python examples/digits_cnn.py --epochs 2               # one process

scikit-learn's 1797 handwritten 8x8 digits, 1437 for training (shuffled by
a seeded ``DataLoader``, the same order on every rank) and 360 to test
(``examples/_workloads.py``).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _workloads import cnn, digits
from torch.utils.data import DataLoader

import dreampipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many updates")
    parser.add_argument("--schedule", default="pipedream")
    args = parser.parse_args()
    train_set, test_set = digits()
    loader = DataLoader(train_set, batch_size=32, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    pipe = dreampipe.Pipeline(
        cnn(), example=next(iter(loader)), loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        plan="auto", config=dreampipe.TrainConfig(schedule=args.schedule),
    )
    steps, losses = 0, []
    for _ in range(args.epochs):
        for xb, yb in loader:
            pipe.step(xb, yb)
            steps += 1
            if args.steps is not None and steps >= args.steps:
                break
        losses += pipe.finish()
        if args.steps is not None and steps >= args.steps:
            break
    result = pipe.evaluate(DataLoader(test_set, batch_size=128))
    if dist.get_rank() == 0:
        print(json.dumps({"plan": pipe.plan.config, "updates": steps, "first_loss": losses[0],
                          "last_loss": losses[-1], "test_loss": result.loss,
                          "test_accuracy": result.accuracy}))
    pipe.close()


if __name__ == "__main__":
    main()

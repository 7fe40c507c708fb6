"""The digits CNN written against ``dreampipe.Pipeline`` with a plain ``DataLoader``.

    torchrun --nproc-per-node 2 examples/digits_cnn.py    # PipeDream, the planner's plan
    python examples/digits_cnn.py --epochs 2               # one process

scikit-learn's 1797 handwritten 8x8 digits, 1437 for training (shuffled by
a seeded ``DataLoader``, the same order on every rank) and 360 to test.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dreampipe


def cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many updates")
    parser.add_argument("--schedule", default="pipedream")
    args = parser.parse_args()
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    train_set, test_set = TensorDataset(x[:1437], y[:1437]), TensorDataset(x[1437:], y[1437:])
    loader = DataLoader(train_set, batch_size=32, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    pipe = dreampipe.Pipeline(
        cnn(), example=next(iter(loader)), loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        schedule=args.schedule, plan="auto",
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

"""A rank function for losses averaged over tokens, not samples: next-token labels with
ignored (padded) positions, and the one-process reference that averages them over the
whole minibatch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dreampipe.api import Pipeline, TrainConfig
from dreampipe.planning.plan import Plan

__all__ = ["LENGTH", "batch", "model", "reference", "token_loss", "train_tokens"]

#: Tokens a sequence; a vocabulary of as many.
LENGTH = 6


def model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(LENGTH * 2, 8), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, LENGTH * 2))


def batch(k: int, n: int) -> tuple[Tensor, Tensor]:
    """Minibatch ``k``: ``n`` sequences whose labels past a random length are ignored
    (-100), so the microbatches count different numbers of tokens."""
    g = torch.Generator().manual_seed(500 + k)
    ids = torch.randint(0, LENGTH * 2, (n, LENGTH), generator=g)
    kept = torch.randint(1, LENGTH + 1, (n, 1), generator=g)
    labels = ((ids + 1) % (LENGTH * 2)).masked_fill(torch.arange(LENGTH) >= kept, -100)
    return ids, labels


def token_loss(out: Tensor, y: Tensor) -> Tensor:
    """The mean over the labelled tokens, as a language model's loss is."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)


def train_tokens(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any] | None:
    """Train ``job["steps"]`` minibatches on ``job["replicas"]`` of two stages, with
    ``ignore_index=-100`` where ``job["weighted"]`` (the labelled tokens count); rank 0
    returns the losses, the state and the held-out loss of ``job["held_out"]`` batches."""
    pipe = Pipeline(model(job["seed"]), example=batch(0, job["minibatch"]),
                    loss_fn=token_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
                    plan=Plan.from_config(4, [0, 2], job["replicas"]),
                    config=TrainConfig(schedule=job["schedule"],
                                       microbatches=job["microbatches"], timeout_s=30.0,
                                       ignore_index=-100 if job["weighted"] else None))
    for k in range(job["steps"]):
        pipe.step(*batch(k, job["minibatch"]))
    losses = pipe.finish()
    held_out = pipe.evaluate([batch(100 + j, job["minibatch"]) for j in range(job["held_out"])])
    state = pipe.full_state_dict()
    pipe.close()
    return ({"losses": losses, "state": state, "held_out": held_out.loss,
             "accuracy": held_out.accuracy} if rank == 0 else None)


def reference(job: dict[str, Any]) -> dict[str, Any]:
    """One process: each minibatch's loss taken whole, its mean over every labelled token."""
    net = model(job["seed"])
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    losses = []
    for k in range(job["steps"]):
        x, y = batch(k, job["minibatch"])
        opt.zero_grad()
        loss = token_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        held = [batch(100 + j, job["minibatch"]) for j in range(job["held_out"])]
        ys = torch.cat([y for _, y in held])
        outs = torch.cat([net(x) for x, _ in held])
        held_out = float(token_loss(outs, ys))
    return {"losses": losses, "state": net.state_dict(), "held_out": held_out}

"""Train, save a checkpoint, reload it into a plain ``nn.Module`` and predict.

    torchrun --nproc-per-node 2 examples/checkpoint_roundtrip.py [--dir ckpt]
    python examples/checkpoint_roundtrip.py

The checkpoint (``torch.distributed.checkpoint``, committed with a marker)
is keyed by the model's own parameter names, so a model built the usual way
loads it with ``load_state_dict``, without dreampipe's process group or plan.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import dreampipe


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(20, 64), nn.LayerNorm(64), nn.GELU(),
                         nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def batch(gen: torch.Generator, weights: Tensor) -> tuple[Tensor, Tensor]:
    """A toy task: which of 4 random directions a point leans towards most."""
    x = torch.randn(64, 20, generator=gen)
    return x, (x @ weights).argmax(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(20, 4, generator=gen)
    torch.manual_seed(0)
    pipe = dreampipe.Pipeline(
        mlp(), example=batch(gen, weights), loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
        config=dreampipe.TrainConfig(schedule="1f1b-flush", microbatches=2),
    )
    for _ in range(args.steps):
        pipe.step(*batch(gen, weights))
    losses = pipe.finish()
    test = [batch(gen, weights) for _ in range(4)]
    accuracy = pipe.evaluate(test).accuracy
    directory = args.dir
    if directory is None:  # one directory for every rank, named by rank 0
        box = [tempfile.mkdtemp(prefix="dreampipe-ckpt-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        directory = box[0]
    saved = pipe.save(directory)
    rank = dist.get_rank()
    pipe.close()
    if rank != 0:
        return
    plain = mlp()
    plain.load_state_dict(dreampipe.load_model_state(saved))
    plain.eval()
    with torch.no_grad():
        right = sum(int((plain(x).argmax(1) == y).sum()) for x, y in test)
    print(json.dumps({"checkpoint": str(saved), "last_loss": losses[-1],
                      "pipeline_accuracy": accuracy,
                      "plain_module_accuracy": right / sum(len(y) for _, y in test)}))


if __name__ == "__main__":
    main()

"""A small GPT-style character-level transformer on the Python standard library's own source.

    torchrun --nproc-per-node 2 examples/char_transformer.py   # about 2 minutes on 2 cores
    python examples/char_transformer.py --steps 20              # one process

The corpus is the ``.py`` files of this Python's standard library (found
through ``sysconfig``), the last tenth held out. The same model trains twice
from the same weights on the same batches: with PipeDream (a straight
pipeline, one stage per worker) and with data parallelism; the script
reports both held-out losses. Every rank runs this script and sees the same
batches; each stage takes what it needs.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from _workloads import char_corpus, gpt, straight_plan, token_loss, windows
from torch import Tensor

import dreampipe


def train(schedule: str, plan: dreampipe.Plan | str, vocab: int, train_data: Tensor,
          held_out: list[tuple[Tensor, Tensor]], args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(0)
    model = gpt(vocab, context=args.context)
    stream = windows(train_data, args.batch, args.context, seed=1)
    pipe = dreampipe.Pipeline(
        model, example=next(windows(train_data, args.batch, args.context, seed=1)),
        loss_fn=token_loss, optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, lambda s: min(1.0, (s + 1) / 20)),
        plan=plan, config=dreampipe.TrainConfig(schedule=schedule, max_grad_norm=1.0),
    )
    start = time.perf_counter()
    for _ in range(args.steps):
        pipe.step(*next(stream))
    losses = pipe.finish()
    seconds = time.perf_counter() - start
    result = pipe.evaluate(held_out)
    pipe.close()
    return {"train_loss": sum(losses[-10:]) / len(losses[-10:]), "held_out_loss": result.loss,
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    corpus = char_corpus()
    held = windows(corpus.held_out, args.batch, args.context, seed=2)
    held_out = [next(held) for _ in range(8)]
    world = dist.get_world_size() if dist.is_initialized() else 1
    straight = straight_plan(7, world)  # embed, 4 blocks, norm, head
    report = {
        "chars": corpus.chars, "vocab": corpus.vocab, "workers": world,
        "pipedream": train("pipedream", straight, corpus.vocab, corpus.train, held_out, args),
        "dp": train("dp", "auto", corpus.vocab, corpus.train, held_out, args),
    }
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps(report))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

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
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import dreampipe


def corpus(max_bytes: int = 3_000_000) -> str:
    """Standard library source, file by file in name order, up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text, size = [], 0
    for path in sorted(root.glob("*.py")):
        part = path.read_text(encoding="utf-8", errors="ignore")
        text.append(part)
        size += len(part)
        if size >= max_bytes:
            break
    return "".join(text)


class Embed(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, dim: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tokens(idx) + self.positions(pos)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def gpt(vocab: int, dim: int = 128, context: int = 64, layers: int = 4, heads: int = 4
        ) -> nn.Sequential:
    return nn.Sequential(Embed(vocab, dim, context), *(Block(dim, heads) for _ in range(layers)),
                         nn.LayerNorm(dim), nn.Linear(dim, vocab))


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def windows(data: Tensor, batch: int, context: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Random windows of ``context`` characters and the next character of each: the same
    stream on every rank (one seeded generator)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
        idx = start[:, None] + torch.arange(context)
        yield data[idx], data[idx + 1]


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
        schedule=schedule, plan=plan, max_grad_norm=1.0,
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
    text = corpus()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([lookup[c] for c in text])
    split = len(data) * 9 // 10
    held = windows(data[split:], args.batch, args.context, seed=2)
    held_out = [next(held) for _ in range(8)]
    world = dist.get_world_size() if dist.is_initialized() else 1
    layers = 7  # embed, 4 blocks, norm, head
    straight = dreampipe.Plan.from_config(
        layers, [round(i * layers / world) for i in range(world)], [1] * world)
    report = {
        "chars": len(text), "vocab": len(chars), "workers": world,
        "pipedream": train("pipedream", straight, len(chars), data[:split], held_out, args),
        "dp": train("dp", "auto", len(chars), data[:split], held_out, args),
    }
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps(report))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

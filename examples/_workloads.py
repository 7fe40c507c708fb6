"""The examples' two workloads, shared with ``benchmarks/convergence.py``.

Digits: scikit-learn's 1797 handwritten 8x8 digits (1437 to train, 360 to
test, split by one fixed shuffle) and a small CNN. Characters: the Python standard library's own
source (found through ``sysconfig``, the last tenth held out) and a small
GPT-style transformer that predicts the next character.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import dreampipe

__all__ = ["Block", "CharCorpus", "Embed", "char_corpus", "cnn", "digits", "gpt", "straight_plan",
           "token_loss", "windows"]

_DIGITS_TRAIN = 1437


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The digits' training and test sets: images scaled to [0, 1], class labels.

    The split is one fixed shuffle: the file's last 360 digits come from
    other writers than the rest, and a test set from them alone plateaus near
    95% accuracy whatever the training does.
    """
    bunch = load_digits()
    order = torch.randperm(len(bunch.target), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1)[order] / 16.0
    y = torch.tensor(bunch.target)[order]
    return (TensorDataset(x[:_DIGITS_TRAIN], y[:_DIGITS_TRAIN]),
            TensorDataset(x[_DIGITS_TRAIN:], y[_DIGITS_TRAIN:]))


def cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def _stdlib_text(max_bytes: int) -> str:
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


class CharCorpus:
    """The corpus as character ids: ``train`` (nine tenths) and ``held_out`` (the rest)."""

    def __init__(self, text: str) -> None:
        self.chars = len(text)
        alphabet = sorted(set(text))
        self.vocab = len(alphabet)
        lookup = {c: i for i, c in enumerate(alphabet)}
        data = torch.tensor([lookup[c] for c in text])
        split = len(data) * 9 // 10
        self.train, self.held_out = data[:split], data[split:]


def char_corpus(max_bytes: int = 3_000_000) -> CharCorpus:
    return CharCorpus(_stdlib_text(max_bytes))


class Embed(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, dim: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        out: Tensor = self.tokens(idx) + self.positions(pos)
        return out


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
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


def gpt(vocab: int, dim: int = 128, context: int = 64, layers: int = 4, heads: int = 4
        ) -> nn.Sequential:
    """Embedding, ``layers`` blocks, a final LayerNorm and the vocabulary head."""
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


def straight_plan(num_layers: int, stages: int) -> dreampipe.Plan:
    """``stages`` stages of about equal layer counts, one worker each."""
    return dreampipe.Plan.from_config(
        num_layers, [round(i * num_layers / stages) for i in range(stages)], [1] * stages)

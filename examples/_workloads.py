"""The examples' workloads, shared with ``benchmarks/convergence.py`` and ``staleness.py``.

Digits: scikit-learn's 1797 handwritten 8x8 digits (1437 to train, 360 to
test, split by one fixed shuffle) and a small CNN. Characters: the Python standard library's own
source (found through ``sysconfig``, the last tenth held out) and a small
GPT-style transformer that predicts the next character. Two more, held out
from the choice of the staleness compensation: a deep ReLU MLP on
scikit-learn's synthetic ``make_classification`` task (:func:`blobs`), and a
tiny Hugging Face GPT-2 with tied embeddings (random init) on the English
prose of Python's documentation topics (``pydoc_data.topics``, :func:`docs_corpus`).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import dreampipe

__all__ = ["Block", "CharCorpus", "Embed", "blobs", "char_corpus", "cnn", "digits", "docs_corpus",
           "gpt", "gpt2", "mlp", "straight_plan", "token_loss", "windows"]

_DIGITS_TRAIN = 1437


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The digits' training and test sets: images scaled to [0, 1], class labels.

    The split is one fixed shuffle: the file's last 360 digits come from
    other writers than the rest, and a test set from them alone plateaus near
    95% accuracy whatever the training does.
    """
    from sklearn.datasets import load_digits  # 4 s to import: only the workloads that use it

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


_BLOBS = 6000  # samples; the last fifth held out


def blobs() -> tuple[TensorDataset, TensorDataset]:
    """A synthetic but learnable 10-class task (``make_classification``: 32 features, 16
    informative, 2 clusters per class, fixed seed), standardised; training and test sets."""
    from sklearn.datasets import make_classification  # as load_digits (digits())

    x, y = make_classification(n_samples=_BLOBS, n_features=32, n_informative=16,
                               n_redundant=8, n_classes=10, n_clusters_per_class=2,
                               class_sep=1.5, flip_y=0.02, random_state=0)
    xt = torch.tensor(x, dtype=torch.float32)
    xt = (xt - xt.mean(0)) / xt.std(0)
    yt = torch.tensor(y)
    split = _BLOBS * 4 // 5
    return TensorDataset(xt[:split], yt[:split]), TensorDataset(xt[split:], yt[split:])


def mlp(features: int = 32, width: int = 128, layers: int = 8, classes: int = 10
        ) -> nn.Sequential:
    """A plain deep MLP: ``layers`` Linear + ReLU layers, then the classifier; He
    initialisation (PyTorch's default shrinks the signal at each layer: 8 would not train)."""
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(features if i == 0 else width, width), nn.ReLU()]
    mods.append(nn.Linear(width, classes))
    for m in mods:
        if isinstance(m, nn.Linear):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
    return nn.Sequential(*mods)


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


def docs_corpus() -> CharCorpus:
    """Python's documentation topics (``pydoc_data.topics``: the language reference's
    English prose, about 465,000 characters, shipped with the interpreter) by name order."""
    from pydoc_data.topics import topics

    return CharCorpus("\n".join(topics[k] for k in sorted(topics)))


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


class _GPT2Embed(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: Tensor) -> Tensor:
        out: Tensor = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return out


class _GPT2Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


class _GPT2Head(nn.Module):
    def __init__(self, ln_f: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.lm_head(self.ln_f(x))
        return out


def gpt2(vocab: int, dim: int = 64, context: int = 64, layers: int = 6, heads: int = 4
         ) -> nn.Sequential:
    """A tiny Hugging Face GPT-2 (random init, no dropout, ``tie_word_embeddings``) as a
    sequence: embeddings, ``layers`` blocks, and the head, whose weight *is* the token
    embedding's (the first and the last stage share it)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=vocab, n_positions=context, n_embd=dim, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None))
    body = model.transformer
    return nn.Sequential(_GPT2Embed(body.wte, body.wpe), *(_GPT2Block(b) for b in body.h),
                         _GPT2Head(body.ln_f, model.lm_head))


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

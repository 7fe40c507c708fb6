"""``gnmt``: a GNMT-style stacked-LSTM translator (Wu et al.), small by default.

Pipeline layers pass ONE tensor, so the source and target sentences travel
together. The input is token ids ``(batch, src_len + tgt_len)``: source
tokens then the (shifted) target tokens. Until the attention layer the
tensor is ``(batch, src_len + tgt_len, hidden)``: encoder layers rewrite the
source part and carry the target embeddings along unchanged. The first
decoder layer attends over the encoder output, and from then on the tensor
is ``(batch, tgt_len, 2·hidden)`` = ``[h | context]`` (GNMT feeds the
context to every decoder layer)::

    embed ─▶ enc0 (bi-LSTM) ─▶ enc1 … ─▶ dec0 (LSTM + attention) ─▶ dec1 … ─▶ classifier
      (B,S+T,H)                            (B,T,2H)                         (B,T,vocab)

Layers from the third encoder/decoder layer on add a residual connection,
as in GNMT. The loss is token-level cross-entropy.
"""

from __future__ import annotations

import torch
from torch import nn

from dreampipe.errors import ProfileError
from dreampipe.models.losses import token_cross_entropy
from dreampipe.models.spec import LayerFactory, ModelSpec

__all__ = ["gnmt"]


class _Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int, src_len: int) -> None:
        super().__init__()
        self.src_len = src_len
        self.source = nn.Embedding(vocab, hidden)
        self.target = nn.Embedding(vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = self.src_len
        return torch.cat([self.source(tokens[:, :s]), self.target(tokens[:, s:])], dim=1)


class _Encoder(nn.Module):
    """One encoder LSTM on the source part; the target embeddings pass through."""

    def __init__(self, hidden: int, src_len: int, bidirectional: bool, residual: bool) -> None:
        super().__init__()
        self.src_len = src_len
        self.residual = residual
        size = hidden // 2 if bidirectional else hidden
        self.lstm = nn.LSTM(hidden, size, batch_first=True, bidirectional=bidirectional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source, target = x[:, : self.src_len], x[:, self.src_len :]
        out, _ = self.lstm(source)
        if self.residual:
            out = out + source
        return torch.cat([out, target], dim=1)


class _AttentionDecoder(nn.Module):
    """First decoder LSTM plus (general, Luong-style) attention over the encoder output."""

    def __init__(self, hidden: int, src_len: int) -> None:
        super().__init__()
        self.src_len = src_len
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.query = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory, target = x[:, : self.src_len], x[:, self.src_len :]
        h, _ = self.lstm(target)
        scores = torch.bmm(self.query(h), memory.transpose(1, 2))
        context = torch.bmm(torch.softmax(scores, dim=-1), memory)
        return torch.cat([h, context], dim=-1)


class _Decoder(nn.Module):
    """A later decoder LSTM fed ``[h | context]``; the context is carried along."""

    def __init__(self, hidden: int, residual: bool) -> None:
        super().__init__()
        self.hidden = hidden
        self.residual = residual
        self.lstm = nn.LSTM(2 * hidden, hidden, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, context = x[..., : self.hidden], x[..., self.hidden :]
        out, _ = self.lstm(x)
        if self.residual:
            out = out + h
        return torch.cat([out, context], dim=-1)


class _Classifier(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.proj = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.proj(x[..., : self.hidden])
        return logits


def gnmt(
    vocab: int = 1000,
    hidden: int = 128,
    layers: int = 4,
    src_len: int = 16,
    tgt_len: int = 16,
) -> ModelSpec:
    """``layers`` encoder and ``layers`` decoder LSTM layers of width ``hidden``."""
    if layers < 2:
        raise ProfileError(f"gnmt layers={layers}: use at least 2 (GNMT-8 uses 8)")
    if hidden < 2 or hidden % 2:
        raise ProfileError(f"gnmt hidden={hidden}: use an even width (bidirectional first layer)")
    factories: list[tuple[str, LayerFactory]] = [
        ("embed", lambda: _Embed(vocab, hidden, src_len)),
        ("enc0", lambda: _Encoder(hidden, src_len, bidirectional=True, residual=False)),
    ]
    for i in range(1, layers):
        factories.append((f"enc{i}", _encoder(hidden, src_len, residual=i >= 2)))
    factories.append(("dec0", lambda: _AttentionDecoder(hidden, src_len)))
    for i in range(1, layers):
        factories.append((f"dec{i}", _decoder(hidden, residual=i >= 2)))
    factories.append(("classifier", lambda: _Classifier(hidden, vocab)))

    def sample_input(batch: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, src_len + tgt_len))

    def sample_target(batch: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, tgt_len))

    return ModelSpec(
        name="gnmt",
        layer_factories=factories,
        sample_input=sample_input,
        sample_target=sample_target,
        loss_fn=token_cross_entropy,
        default_batch_size=32,
    )


def _encoder(hidden: int, src_len: int, residual: bool) -> LayerFactory:
    return lambda: _Encoder(hidden, src_len, bidirectional=False, residual=residual)


def _decoder(hidden: int, residual: bool) -> LayerFactory:
    return lambda: _Decoder(hidden, residual)

"""``transformer``: a small GPT-style decoder-only language model.

::

    tokens (B,T) ─embed─▶ (B,T,D) ─block0─▶ … ─block{n-1}─▶ (B,T,D) ─head─▶ (B,T,vocab)

``embed`` adds token and learned position embeddings; each block is
pre-LayerNorm causal self-attention plus an MLP, both with residuals inside
the block, so the model is a straight ``nn.Sequential``; ``head`` is the
final LayerNorm and the vocabulary projection. The target is the input
shifted by one token.
"""

from __future__ import annotations

import torch
from torch import nn

from dreampipe.errors import ProfileError
from dreampipe.models.losses import token_cross_entropy
from dreampipe.models.spec import LayerFactory, ModelSpec

__all__ = ["CausalAttention", "TransformerBlock", "transformer"]


class _Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, seq_len: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(seq_len, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        out: torch.Tensor = self.token(tokens) + self.position(positions)
        return out


class CausalAttention(nn.Module):
    """The core attention of ``heads`` heads: ``softmax(q k^T / sqrt(d)) v``, causal, from
    the packed ``q k v`` projections; no weights (the block's selective recomputation
    recomputes it, as Megatron-LM's does, docs/design.md §4.6)."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        b, t, d3 = qkv.shape
        d = d3 // 3
        q, k, v = (
            z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for z in qkv.chunk(3, dim=-1)
        )
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attn.transpose(1, 2).reshape(b, t, d)


class TransformerBlock(nn.Module):
    """``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, causal, ``heads`` heads."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn = CausalAttention(heads)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.proj(self.attn(self.qkv(self.ln1(x)))))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


def transformer(
    vocab: int = 1000,
    dim: int = 128,
    heads: int = 4,
    layers: int = 4,
    seq_len: int = 32,
    dropout: float = 0.0,
) -> ModelSpec:
    """``layers`` blocks of width ``dim`` over sequences of ``seq_len`` tokens."""
    for name, value in (("vocab", vocab), ("dim", dim), ("heads", heads), ("layers", layers),
                        ("seq_len", seq_len)):
        if value < 1:
            raise ProfileError(f"transformer {name}={value}: use at least 1")
    if dim % heads:
        raise ProfileError(f"transformer dim={dim} is not divisible by heads={heads}")
    factories: list[tuple[str, LayerFactory]] = [("embed", lambda: _Embed(vocab, dim, seq_len))]
    factories += [
        (f"block{i}", lambda: TransformerBlock(dim, heads, dropout)) for i in range(layers)
    ]
    factories.append(("head", lambda: nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))))

    def sample_input(batch: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, seq_len))

    def sample_target(batch: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, seq_len))

    return ModelSpec(
        name="transformer",
        layer_factories=factories,
        sample_input=sample_input,
        sample_target=sample_target,
        loss_fn=token_cross_entropy,
        default_batch_size=16,
    )

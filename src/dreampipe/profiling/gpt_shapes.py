"""A GPT-style transformer's profile from its layer shapes, for planning studies at scale.

A model too large to profile here (GPT-3 1.3B, Megatron-LM's 8.3B) gets a
profile from its shapes: each transformer block becomes six layers whose
times come from their floating-point work (or bytes moved) and whose sizes
from their tensors, as Megatron-LM counts them (docs/design.md §2, "Profiles
from shapes"; :func:`gpt_profile` lists the layers). Their descriptions let
the operator search (:mod:`dreampipe.planning.splits`) split each block as
Megatron-LM's tensor parallelism does.
"""

from __future__ import annotations

from dataclasses import dataclass

from dreampipe.profiling.graph import Layer, LayerGraph

__all__ = ["GPT3_1_3B", "MEGATRON_8_3B", "GptShape", "gpt_profile"]


@dataclass(frozen=True)
class GptShape:
    """A GPT-style model: ``layers`` blocks of width ``hidden`` with ``heads`` attention
    heads over ``seq`` tokens and a ``vocab``-word vocabulary; ``batch`` sequences per
    minibatch (the pipeline's microbatch, as Megatron-LM says)."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int

    @property
    def parameters(self) -> int:
        """Weights and biases of the blocks, the embedding and the head."""
        h = self.hidden
        block = 12 * h * h + 13 * h
        return self.layers * block + 2 * self.vocab * h + self.seq * h + 2 * h

    def update_flops(self, global_batch: int) -> float:
        """Floating-point operations of one update of ``global_batch`` sequences by
        Megatron-LM's count (Narayanan et al. 2021, §5.1), the forward once more for
        activation recomputation: ``96 B s l h^2 (1 + s / 6h + V / 16lh)``."""
        b, s, n, h, v = global_batch, self.seq, self.layers, self.hidden, self.vocab
        return 96.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


#: GPT-3 XL (Brown et al., "Language Models are Few-Shot Learners", Table 2.1).
GPT3_1_3B = GptShape("gpt3-1.3b", 24, 2048, 16, 2048, 50257, 4)
#: The 8.3 billion parameter model of Shoeybi et al., "Megatron-LM: Training Multi-Billion
#: Parameter Language Models Using Model Parallelism" (Table 1: 72 layers, 3072 wide, 32
#: heads, 1024 tokens).
MEGATRON_8_3B = GptShape("megatron-8.3b", 72, 3072, 32, 1024, 51200, 8)


def gpt_profile(shape: GptShape, flops_per_s: float, *, parameter_bytes: int = 4,
                memory_bandwidth: float = 900e9) -> LayerGraph:
    """The profile of ``shape``: matrix products at ``flops_per_s`` sustained, LayerNorms
    and the embedding at ``memory_bandwidth`` bytes/s (they move, not multiply), every
    backward twice its forward, weights and gradients ``parameter_bytes`` per parameter.

    Each block's layers keep what Megatron-LM counts in 16-bit activations
    (``34 s b h + 5 a s^2 b`` bytes per block; docs/design.md §2)::

        ln1       LayerNorm(h)              keeps its output          2 sbh
        attn_in   Linear(h, 3h) + attention keeps Q, K, V, scores     8 sbh + 5 a s^2 b
        attn_out  Linear(h, h)              keeps output, dropout     3 sbh
        ln2       LayerNorm(h)                                        2 sbh
        fc1       Linear(h, 4h) + GELU()    keeps GELU in and out     16 sbh
        fc2       Linear(4h, h)             keeps output, dropout     3 sbh

    An embedding starts the model and a final LayerNorm and the vocabulary projection
    (untied) end it.
    """
    b, s, h, a, v = shape.batch, shape.seq, shape.hidden, shape.heads, shape.vocab
    sbh = s * b * h
    p = parameter_bytes

    def dense(name: str, flops: float, out: int, weights: int, what: str, kept: int) -> Layer:
        ms = flops / flops_per_s * 1e3
        return Layer(name, ms, 2 * ms, out, weights * p, what, saved_bytes=kept)

    def moving(name: str, moved: float, out: int, weights: int, what: str) -> Layer:
        ms = moved / memory_bandwidth * 1e3
        return Layer(name, ms, 2 * ms, out, weights * p, what, saved_bytes=out)

    layers = [moving("embed", 2 * 2 * sbh, 2 * sbh, v * h + s * h, f"Embedding({v}, {h})")]
    for k in range(shape.layers):
        layers += [
            moving(f"b{k}.ln1", 2 * 2 * sbh, 2 * sbh, 2 * h, f"LayerNorm({h})"),
            dense(f"b{k}.attn_in", 2 * 3 * sbh * h + 4 * s * sbh, 2 * sbh, 3 * h * h + 3 * h,
                  f"Linear({h}, {3 * h}) + attention({a} heads)", 8 * sbh + 5 * a * s * s * b),
            dense(f"b{k}.attn_out", 2 * sbh * h, 2 * sbh, h * h + h, f"Linear({h}, {h})",
                  3 * sbh),
            moving(f"b{k}.ln2", 2 * 2 * sbh, 2 * sbh, 2 * h, f"LayerNorm({h})"),
            dense(f"b{k}.fc1", 2 * 4 * sbh * h, 8 * sbh, 4 * h * h + 4 * h,
                  f"Linear({h}, {4 * h}) + GELU()", 16 * sbh),
            dense(f"b{k}.fc2", 2 * 4 * sbh * h, 2 * sbh, 4 * h * h + h,
                  f"Linear({4 * h}, {h})", 3 * sbh),
        ]
    layers += [
        moving("final_ln", 2 * 2 * sbh, 2 * sbh, 2 * h, f"LayerNorm({h})"),
        dense("head", 2 * sbh * v, 2 * s * b * v, h * v, f"Linear({h}, {v})", 2 * s * b * v),
    ]
    return LayerGraph.chain(layers, batch_size=b, model=shape.name)

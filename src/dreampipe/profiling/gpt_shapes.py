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

import re
from collections.abc import Iterable
from dataclasses import dataclass

from dreampipe.profiling.graph import Layer, LayerGraph

__all__ = ["ATTENTION_BYTES", "GELU_BYTES", "GPT3_1_3B", "MEGATRON_8_3B", "NORM_BYTES",
           "OPERAND_BYTES", "SCORE_BYTES", "GptShape", "attention_products_ms", "block_index",
           "blocks_recomputed", "gpt_profile"]

#: Bytes moved (forward, backward) per attention score: the fused scale-mask-softmax reads
#: and writes it (2 + 2, 16-bit), the dropout reads it, writes it and its 1-byte mask; back,
#: the dropout takes the gradient and the mask and gives a gradient (2 + 1 + 2), the
#: softmax takes the gradient and its output and gives a gradient (2 + 2 + 2).
SCORE_BYTES = (9, 11)
#: Bytes moved per ``s b h`` by the fused bias-GELU over the ``4h`` features (input in and
#: output out; back: gradient and input in, gradient out), 16-bit.
GELU_BYTES = (16, 24)
#: Bytes moved per ``s b h`` by the fused bias-dropout-add before each LayerNorm (output
#: and residual in, output and 1-byte mask out; back: gradient and mask in, gradient out)
#: and by the LayerNorm itself (in and out; back twice that).
NORM_BYTES = (7 + 4, 5 + 8)
#: Bytes of a matrix product's operand element: Megatron-LM multiplies in 16 bits.
OPERAND_BYTES = 2
#: Bytes moved per attention score by its batched products, 16-bit (forward: Q K^T writes
#: it, the product with V reads it; backward: the probabilities' gradient is written, the
#: probabilities read for V's gradient, the scores' gradient read for Q's and for K's).
ATTENTION_BYTES = (4, 8)
#: A block's layer, ``b<k>.<part>``.
_BLOCK_LAYER = re.compile(r"b(\d+)\.")


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

    def update_flops(self, global_batch: int, recomputed: float | None = None) -> float:
        """Floating-point operations of one update of ``global_batch`` sequences by
        Megatron-LM's count (Narayanan et al. 2021, §5.1): ``72 B s l h^2 (1 + s / 6h)``
        for the blocks' forward and backward, ``24 B s h^2 (1 + s / 6h)`` more for each
        of the ``recomputed`` blocks whose forward runs again (default: every block, the
        published ``96 B s l h^2 (1 + s / 6h + V / 16lh)``), and ``6 B s h V`` for the
        head, which no run recomputes. Counting what a plan runs keeps the rate per GPU
        a rate: a plan that keeps its activations does less work, not more per second."""
        b, s, n, h, v = global_batch, self.seq, self.layers, self.hidden, self.vocab
        again = float(n) if recomputed is None else recomputed
        if not 0 <= again <= n:
            raise ValueError(f"recomputed={recomputed}: give 0 to {n} blocks")
        return (72.0 * n + 24.0 * again) * b * s * h * h * (1 + s / (6 * h)) \
            + 6.0 * b * s * h * v


#: GPT-3 XL (Brown et al., "Language Models are Few-Shot Learners", Table 2.1).
GPT3_1_3B = GptShape("gpt3-1.3b", 24, 2048, 16, 2048, 50257, 4)
#: The 8.3 billion parameter model of Shoeybi et al., "Megatron-LM: Training Multi-Billion
#: Parameter Language Models Using Model Parallelism" (Table 1: 72 layers, 3072 wide, 32
#: heads, 1024 tokens).
MEGATRON_8_3B = GptShape("megatron-8.3b", 72, 3072, 32, 1024, 51200, 8)


def gpt_profile(shape: GptShape, flops_per_s: float, *, parameter_bytes: int = 4,
                memory_bandwidth: float = 900e9) -> LayerGraph:
    """The profile of ``shape``: matrix products at ``flops_per_s`` sustained, or at
    ``memory_bandwidth`` for their 16-bit operands where those take longer (the roofline:
    attention's batched products over narrow heads), each backward twice its forward;
    what moves rather than multiplies at ``memory_bandwidth``
    bytes/s (Megatron-LM's fused kernels, Narayanan et al. 2021, §4.2): the embedding, each
    LayerNorm with the bias-dropout-add before it (:data:`NORM_BYTES`), the bias-GELU
    (:data:`GELU_BYTES`) and the softmax, mask and dropout over the ``a s^2 b`` attention
    scores (:data:`SCORE_BYTES`), whose share of the matrix products grows as
    ``a s / h^2``; weights and gradients ``parameter_bytes`` per parameter.

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
    scores = a * s * s * b
    p = parameter_bytes

    def product(flops: float, operands: float) -> float:
        return _product_ms(flops, operands, flops_per_s, memory_bandwidth)

    def dense(name: str, features: tuple[int, int], out: int, weights: int, what: str,
              kept: int, moved: tuple[float, float], core: tuple[float, float] = (0, 0)
              ) -> Layer:
        k, n = features  # a (s b, k) x (k, n) product; backward, dX and dW alike
        ms = product(2 * s * b * k * n, OPERAND_BYTES * (s * b * k + k * n + s * b * n))
        forward, backward = (x / memory_bandwidth * 1e3 for x in moved)
        return Layer(name, ms + core[0] + forward, 2 * ms + core[1] + backward, out,
                     weights * p, what, saved_bytes=kept, weight_grad_ms=ms)

    def moving(name: str, moved: tuple[float, float], out: int, weights: int,
               what: str) -> Layer:
        forward, backward = (x / memory_bandwidth * 1e3 for x in moved)
        return Layer(name, forward, backward, out, weights * p, what, saved_bytes=out)

    def per(unit: float, table: tuple[int, int]) -> tuple[float, float]:
        return table[0] * unit, table[1] * unit

    norm = per(sbh, NORM_BYTES)
    attention = attention_products_ms(s, b, h, a, flops_per_s, memory_bandwidth)
    layers = [moving("embed", (4 * sbh, 8 * sbh), 2 * sbh, v * h + s * h,
                     f"Embedding({v}, {h})")]
    for k in range(shape.layers):
        layers += [
            moving(f"b{k}.ln1", norm, 2 * sbh, 2 * h, f"LayerNorm({h})"),
            dense(f"b{k}.attn_in", (h, 3 * h), 2 * sbh, 3 * h * h + 3 * h,
                  f"Linear({h}, {3 * h}) + attention({a} heads)", 8 * sbh + 5 * scores,
                  per(scores, SCORE_BYTES), attention),
            dense(f"b{k}.attn_out", (h, h), 2 * sbh, h * h + h, f"Linear({h}, {h})",
                  3 * sbh, (0.0, 0.0)),
            moving(f"b{k}.ln2", norm, 2 * sbh, 2 * h, f"LayerNorm({h})"),
            dense(f"b{k}.fc1", (h, 4 * h), 8 * sbh, 4 * h * h + 4 * h,
                  f"Linear({h}, {4 * h}) + GELU()", 16 * sbh, per(sbh, GELU_BYTES)),
            dense(f"b{k}.fc2", (4 * h, h), 2 * sbh, 4 * h * h + h,
                  f"Linear({4 * h}, {h})", 3 * sbh, (0.0, 0.0)),
        ]
    layers += [
        moving("final_ln", norm, 2 * sbh, 2 * h, f"LayerNorm({h})"),
        dense("head", (h, v), 2 * s * b * v, h * v, f"Linear({h}, {v})", 2 * s * b * v,
              (0.0, 0.0)),
    ]
    return LayerGraph.chain(layers, batch_size=b, model=shape.name)


def attention_products_ms(seq: int, batch: int, hidden: int, heads: int, flops_per_s: float,
                          memory_bandwidth: float) -> tuple[float, float]:
    """Forward and backward milliseconds of attention's batched products, Q K^T and the
    scores times V: ``2 s^2 (h / a) b`` FLOPs a head each, reading and writing 16-bit
    scores (:data:`ATTENTION_BYTES`) and ``s b h``-sized operands; back, four such
    products. Each at the roofline (:func:`gpt_profile`)."""
    sbh, scores = seq * batch * hidden, heads * seq * seq * batch
    return (_product_ms(4 * seq * sbh, ATTENTION_BYTES[0] * scores + 4 * OPERAND_BYTES * sbh,
                        flops_per_s, memory_bandwidth),
            _product_ms(8 * seq * sbh, ATTENTION_BYTES[1] * scores + 8 * OPERAND_BYTES * sbh,
                        flops_per_s, memory_bandwidth))


def _product_ms(flops: float, operands: float, flops_per_s: float,
                memory_bandwidth: float) -> float:
    """A product's milliseconds: its work at the product rate or its operands' bytes at
    the memory rate, whichever takes longer (the roofline)."""
    return max(flops / flops_per_s, operands / memory_bandwidth) * 1e3


def block_index(name: str) -> int | None:
    """The block of a layer named ``name`` (``b<k>.<part>``, :func:`gpt_profile`), None
    for the layers outside blocks (the embedding, the head)."""
    found = _BLOCK_LAYER.match(name)
    return None if found is None else int(found.group(1))


def blocks_recomputed(graph: LayerGraph, layers: Iterable[int]) -> float:
    """How many of ``graph``'s blocks ``layers`` (indices of recomputed layers) amount to,
    by the blocks' forward time: what :meth:`GptShape.update_flops` counts as recomputed.
    A block's layers are named ``b<k>.<part>`` (:func:`gpt_profile`)."""
    block = {i: b for i, x in enumerate(graph.layers) if (b := block_index(x.name)) is not None}
    total = sum(graph.layers[i].forward_ms for i in block)
    if total <= 0:
        return 0.0
    again = sum(graph.layers[i].forward_ms for i in set(layers) if i in block)
    count = len(set(block.values()))
    return min(float(count), count * again / total)

"""What ``dreampipe bench`` trains: a model cut into 2 stages, and the update size.

Three workloads, one shape: ``batch`` samples per weight update, split by the
pipelines into ``microbatches`` microbatches; PipeDream's minibatch and
DDP's share per worker are both ``batch / 2`` (the PipeDream paper pairs a
PipeDream minibatch with data parallelism's per-worker minibatch).

- ``mlp``: the zoo mlp, 8 Linear layers of 1024, 2 stages of 4; 256 samples
  per update as 8 microbatches of 32. Every parameter is in an ``nn.Linear``.
- ``transformer``: the zoo transformer, 4 GPT-style blocks (causal
  self-attention, LayerNorm, GELU MLP) of width 256 over sequences of 32
  tokens, with a 256-token vocabulary; stage 0 is the embedding and 2
  blocks, stage 1 the other 2 and the head. 16 sequences per update as 8
  microbatches of 2 (64 token rows).
- ``llama``: Hugging Face's ``LlamaForCausalLM``, randomly initialised (never
  downloaded): 4 layers of width 256 (4 heads, SwiGLU of 688), a 256-token
  vocabulary, sequences of 64; cut as it is at ``model.layers.2``. 16 sequences
  per update as 8 microbatches of 2. It needs ``transformers``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dreampipe.commands.bench_names import WorkloadKind
from dreampipe.errors import ConfigError, DreampipeError
from dreampipe.models import ModelSpec, get_model
from dreampipe.planning.placement import Placement
from dreampipe.planning.plan import Plan

__all__ = ["Workload", "WorkloadKind", "causal_lm_loss"]


@dataclass(frozen=True)
class _Preset:
    model_kwargs: tuple[tuple[str, Any], ...]
    stage_bounds: tuple[int, ...]
    batch: int
    about: str
    #: The 4 chunks of the interleaved runs (2 per worker), each a half of a stage.
    chunk_bounds: tuple[int, ...]
    #: A Hugging Face model's layers as dreampipe cuts it (empty: a zoo model).
    layer_names: tuple[str, ...] = ()


_PRESETS = {
    WorkloadKind.MLP: _Preset(
        (("layers", 8), ("width", 1024)), (0, 4), 256,
        "mlp 8x1024, 2 stages of 4 layers", (0, 2, 4, 6),
    ),
    WorkloadKind.TRANSFORMER: _Preset(
        (("vocab", 256), ("dim", 256), ("heads", 4), ("layers", 4), ("seq_len", 32)), (0, 3), 16,
        "transformer 4 blocks of 256 (4 heads, 32 tokens), 2 stages: embed+2 blocks | "
        "2 blocks+head", (0, 2, 3, 4),
    ),
    WorkloadKind.LLAMA: _Preset(
        (("vocab_size", 256), ("hidden_size", 256), ("intermediate_size", 688),
         ("num_hidden_layers", 4), ("num_attention_heads", 4), ("num_key_value_heads", 4),
         ("max_position_embeddings", 64), ("use_cache", False)), (0, 4), 16,
        "Hugging Face LlamaForCausalLM 4 layers of 256 (4 heads, 64 tokens), 2 stages: "
        "embed+2 layers | 2 layers+norm+head", (0, 3, 4, 5),
        ("model.embed_tokens", "model.rotary_emb", *(f"model.layers.{i}" for i in range(4)),
         "model.norm", "lm_head"),
    ),
}

#: Tokens per sequence of the llama workload.
_LLAMA_TOKENS = 64


@dataclass(frozen=True)
class Workload:
    """One workload: ``steps`` timed weight updates of ``batch`` samples after ``warmup``.

    :meth:`of` gives a workload its own update size (256 samples for the mlp,
    16 sequences for the transformer).
    """

    kind: WorkloadKind = WorkloadKind.MLP
    batch: int = 256
    microbatches: int = 8
    steps: int = 20
    warmup: int = 3
    lr: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch % self.microbatches or self.batch % len(self.stage_bounds):
            raise DreampipeError(
                f"bench batch {self.batch} is not divisible by {self.microbatches} "
                f"microbatches and {len(self.stage_bounds)} workers; pick a batch that is"
            )
        if self.steps < 1 or self.warmup < 0:
            raise ConfigError(
                f"bench steps={self.steps}, warmup={self.warmup}: use at least 1 timed step "
                "and no negative warm-up", "steps", "warmup",
            )

    @classmethod
    def of(cls, kind: WorkloadKind, *, steps: int = 20, warmup: int = 3) -> Workload:
        """Workload ``kind`` at its own update size."""
        return cls(kind, _PRESETS[kind].batch, steps=steps, warmup=warmup)

    @property
    def per_worker(self) -> int:
        """PipeDream's minibatch, DDP's share of an update per worker: ``batch / 2``."""
        return self.batch // len(self.stage_bounds)

    @property
    def microbatch(self) -> int:
        """Samples per microbatch of the pipelines' updates."""
        return self.batch // self.microbatches

    @property
    def stage_bounds(self) -> tuple[int, ...]:
        """Each pipeline stage's first layer."""
        return _PRESETS[self.kind].stage_bounds

    @property
    def model_kwargs(self) -> tuple[tuple[str, Any], ...]:
        """The zoo model's size."""
        return _PRESETS[self.kind].model_kwargs

    @property
    def hf(self) -> bool:
        """Whether the model is a Hugging Face model passed whole (cut at split points),
        not a zoo model built by stages."""
        return bool(_PRESETS[self.kind].layer_names)

    @property
    def workers(self) -> int:
        """Ranks of every pipeline run: one per stage."""
        return len(self.stage_bounds)

    def spec(self) -> ModelSpec:
        """The zoo model this workload trains (a ConfigError for a Hugging Face model)."""
        if self.hf:
            raise ConfigError(f"the {self.kind.value} workload is a Hugging Face model, not "
                              "a zoo model: build it with Workload.model()", "workload")
        return get_model(self.kind.value, **dict(self.model_kwargs))

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The model's layers, in order, as dreampipe cuts it."""
        return _PRESETS[self.kind].layer_names or tuple(self.spec().layer_names)

    def model(self) -> nn.Module:
        """The whole model under the workload's seed, as a user's script builds it."""
        if not self.hf:
            return self.spec().build(seed=self.seed)
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError as e:
            raise ConfigError("the llama workload needs Hugging Face transformers: "
                              "pip install transformers", "workload") from e
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return LlamaForCausalLM(LlamaConfig(**dict(self.model_kwargs)))

    def split_points(self, virtual_stages: int = 1) -> list[str]:
        """The names of the layers that begin stages 1, 2, ... of :meth:`bounds`."""
        return [self.layer_names[b] for b in self.bounds(virtual_stages)[1:]]

    @property
    def loss_fn(self) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """The loss of the model's output against the target."""
        return causal_lm_loss if self.hf else self.spec().loss_fn

    def bounds(self, virtual_stages: int = 1) -> tuple[int, ...]:
        """Each stage's first layer: the 2 stages, or (``virtual_stages`` 2) the 4 chunks
        the interleaved runs put 2 to a worker."""
        if virtual_stages not in (1, 2):
            raise ConfigError(f"bench virtual_stages={virtual_stages}; the workloads have "
                              "cuts for 1 and 2", "virtual_stages")
        return self.stage_bounds if virtual_stages == 1 else _PRESETS[self.kind].chunk_bounds

    def stage_range(self, stage: int, virtual_stages: int = 1) -> tuple[int, int]:
        """First and last layer (inclusive) of pipeline stage ``stage`` (of :meth:`bounds`)."""
        edges = [*self.bounds(virtual_stages), len(self.layer_names)]
        return edges[stage], edges[stage + 1] - 1

    def plan(self, virtual_stages: int = 1, placement: Placement = Placement.LOOP) -> Plan:
        """The straight pipeline of :meth:`bounds`, ``virtual_stages`` stages per worker
        where ``placement`` puts them."""
        bounds = self.bounds(virtual_stages)
        return Plan.from_config(len(self.layer_names), list(bounds), [1] * len(bounds),
                                model=self.kind.value, layer_names=self.layer_names,
                                virtual_stages=virtual_stages, placement=placement)

    def data(self, batch: int) -> tuple[Any, torch.Tensor]:
        """One fixed synthetic batch, reused every step so data costs nothing; a Hugging
        Face model's input is the dict of its keyword arguments."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + 1000)
            if self.hf:
                vocab = dict(self.model_kwargs)["vocab_size"]
                ids = torch.randint(0, vocab, (batch, _LLAMA_TOKENS + 1))
                return {"input_ids": ids[:, :-1]}, ids[:, 1:]  # the next token to learn
            spec = self.spec()
            return spec.sample_input(batch), spec.sample_target(batch)

    def describe(self) -> str:
        """One line: the model, its cut, and the update."""
        return (f"{_PRESETS[self.kind].about}; {self.batch} samples/update as "
                f"{self.microbatches} microbatches of {self.microbatch}")


def causal_lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a causal LM's logits over every token: ``out`` is a Hugging Face
    output, or the logits (alone or first of a tuple) as ``torch.distributed.pipelining``
    hands them on."""
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())

"""What ``dreampipe bench`` trains: a zoo model cut into 2 stages, and the update size.

Two workloads, one shape: ``batch`` samples per weight update, split by the
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dreampipe.commands.bench_names import WorkloadKind
from dreampipe.errors import ConfigError, DreampipeError
from dreampipe.models import ModelSpec, get_model
from dreampipe.planning.plan import Plan

__all__ = ["Workload", "WorkloadKind"]


@dataclass(frozen=True)
class _Preset:
    model_kwargs: tuple[tuple[str, Any], ...]
    stage_bounds: tuple[int, ...]
    batch: int
    about: str
    #: The 4 chunks of the interleaved runs (2 per worker), each a half of a stage.
    chunk_bounds: tuple[int, ...]


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
}


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

    def spec(self) -> ModelSpec:
        """The zoo model this workload trains."""
        return get_model(self.kind.value, **dict(self.model_kwargs))

    def bounds(self, virtual_stages: int = 1) -> tuple[int, ...]:
        """Each stage's first layer: the 2 stages, or (``virtual_stages`` 2) the 4 chunks
        the interleaved runs put 2 to a worker."""
        if virtual_stages not in (1, 2):
            raise ConfigError(f"bench virtual_stages={virtual_stages}; the workloads have "
                              "cuts for 1 and 2", "virtual_stages")
        return self.stage_bounds if virtual_stages == 1 else _PRESETS[self.kind].chunk_bounds

    def stage_range(self, stage: int, virtual_stages: int = 1) -> tuple[int, int]:
        """First and last layer (inclusive) of pipeline stage ``stage`` (of :meth:`bounds`)."""
        edges = [*self.bounds(virtual_stages), self.spec().num_layers]
        return edges[stage], edges[stage + 1] - 1

    def plan(self, virtual_stages: int = 1) -> Plan:
        """The straight pipeline of :meth:`bounds`, ``virtual_stages`` stages per worker."""
        spec = self.spec()
        bounds = self.bounds(virtual_stages)
        return Plan.from_config(spec.num_layers, list(bounds), [1] * len(bounds),
                                model=self.kind.value, layer_names=tuple(spec.layer_names),
                                virtual_stages=virtual_stages)

    def data(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One fixed synthetic batch, reused every step so data costs nothing."""
        spec = self.spec()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + 1000)
            return spec.sample_input(batch), spec.sample_target(batch)

    def describe(self) -> str:
        """One line: the model, its cut, and the update."""
        return (f"{_PRESETS[self.kind].about}; {self.batch} samples/update as "
                f"{self.microbatches} microbatches of {self.microbatch}")

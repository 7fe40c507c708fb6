"""ZeRO for a replicated stage: each of its ``r`` replicas keeps 1/r of the optimizer's state.

The rule (Rajbhandari et al. 2020): every parameter, flattened, is cut into ``r`` contiguous
chunks of ``ceil(n / r)`` values (the last ones shorter, maybe empty); replica ``k`` owns
chunk ``k`` of each. **Level 1**: the gradients are all-reduced as without ZeRO
(:mod:`.buckets`); the optimizer, built by the user's factory on one 1-D ``nn.Parameter``
per parameter (its chunk), steps only this replica's chunks; an all-gather then puts the
updated chunks back into the full parameters. **Level 2**: the round's ``ALLREDUCE`` is a
reduce-scatter instead (:class:`ShardBuckets`, by bucket as the backward finishes them):
a replica keeps only its chunks of the summed gradient, and the full buffers go (level 3,
:mod:`.zero_params`, also frees the full weights between uses).

Why one parameter per chunk and not one flat buffer: the user's factory sees as many
parameters, in the same order, as without ZeRO (its parameter groups, the staleness
compensation and the checkpoints' ``optim.<name>.<key>`` entries stay per parameter), and
an elementwise optimizer (SGD, Adam, AdamW...) steps each value exactly as it would the
whole. Collectives go one per bucket (chunks packed rank-major into a flat buffer).
Optimizers that look across a whole tensor (LAMB's trust ratio, Adafactor's factored
moments) see a chunk instead. A chunk parameter is a view of the live 32-bit weights
(level 3: a copy), or the 32-bit master of a bf16 chunk. docs/design.md §5.6.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dreampipe.errors import ConfigError
from dreampipe.runtime import buckets as buckets_module
from dreampipe.runtime.buckets import GradientBuckets, Wait
from dreampipe.runtime.precision import Precision
from dreampipe.scheduling.actions import Action, ActionKind

__all__ = ["MAX_LEVEL", "ShardBuckets", "ZeroPlace", "ZeroShards", "stage_buckets"]

#: The highest level: 3, parameters sharded between uses (:mod:`.zero_params`).
MAX_LEVEL = 3


@dataclass(frozen=True)
class ZeroPlace:
    """A stage's ZeRO ``level`` and this rank's place: replica ``replica`` of ``replicas``.

    ``active`` is False at level 0 or on a stage that is not replicated: sharding over one
    replica is no sharding, so such a stage runs as without ZeRO (not an error: one
    ``zero`` setting serves every stage of a plan)."""

    level: int
    replica: int
    replicas: int

    def __post_init__(self) -> None:
        if not 0 <= self.level <= MAX_LEVEL:
            raise ConfigError(f"zero={self.level}; give 0, 1, 2 or 3", "zero")
        if not 0 <= self.replica < self.replicas:
            raise ValueError(f"replica {self.replica} is outside 0..{self.replicas - 1}")

    @property
    def active(self) -> bool:
        return self.level >= 1 and self.replicas > 1


@dataclass
class _Bucket:
    """Parameters collected together, each holding ``chunk[i]`` values per replica at
    ``offset[i]`` of the bucket's per-replica stretch of ``size`` values."""

    indices: list[int]
    offsets: list[int]
    size: int
    dtype: torch.dtype


class _Layout:
    """Where each parameter's chunks lie (module docstring), and the buckets, as
    :class:`~.buckets.GradientBuckets` makes them (reverse order, a cap, one dtype)."""

    def __init__(self, params: Sequence[Tensor], place: ZeroPlace, cap_mb: float) -> None:
        r, k = place.replicas, place.replica
        self.replicas = r
        self.numel = [p.numel() for p in params]
        self.chunk = [math.ceil(n / r) for n in self.numel]
        self.lo = [min(k * c, n) for c, n in zip(self.chunk, self.numel, strict=True)]
        self.hi = [min(lo + c, n) for lo, c, n in zip(self.lo, self.chunk, self.numel,
                                                      strict=True)]
        self.buckets: list[_Bucket] = []
        self.where: list[tuple[int, int]] = [(0, 0)] * len(params)
        cap, size = cap_mb * 1e6, 0.0
        for i in reversed(range(len(params))):
            last = self.buckets[-1] if self.buckets else None
            if last is None or size >= cap or last.dtype != params[i].dtype:
                last = _Bucket([], [], 0, params[i].dtype)
                self.buckets.append(last)
                size = 0.0
            self.where[i] = (len(self.buckets) - 1, len(last.indices))
            last.indices.append(i)
            last.offsets.append(last.size)
            last.size += self.chunk[i]
            size += params[i].numel() * params[i].element_size()

    def shard(self, i: int, flat: Tensor) -> Tensor:
        """This replica's chunk of parameter ``i``'s values ``flat`` (1-D), a view."""
        return flat[self.lo[i]:self.hi[i]]

    def scatter_input(self, b: _Bucket, grads: Sequence[Tensor]) -> Tensor:
        """The reduce-scatter's input of bucket ``b``: replica ``j``'s stretch holds chunk
        ``j`` of each gradient (``grads`` in ``b.indices`` order), zero-padded."""
        buf = torch.zeros(self.replicas, b.size, dtype=b.dtype, device=grads[0].device)
        for i, off, g in zip(b.indices, b.offsets, grads, strict=True):
            flat, c = g.reshape(-1), self.chunk[i]
            for j in range(self.replicas):
                part = flat[j * c:(j + 1) * c]
                buf[j, off:off + part.numel()] = part
        return buf.view(-1)

    def gather(self, b: _Bucket, shards: Sequence[Tensor], group: Any) -> tuple[Tensor, Any]:
        """Start the all-gather of ``shards`` (this replica's chunks, in ``b.indices`` order):
        the output, ``(replicas, b.size)`` once the returned work is done."""
        send = torch.zeros(b.size, dtype=b.dtype, device=shards[0].device if shards else None)
        for off, s in zip(b.offsets, shards, strict=True):
            send[off:off + s.numel()] = s
        out = torch.empty(self.replicas * b.size, dtype=b.dtype, device=send.device)
        return out, dist.all_gather_single(out, send, group=group, async_op=True)

    def whole(self, i: int, out: Tensor, b: _Bucket, k: int) -> Tensor:
        """Parameter ``i``'s full values (1-D) from its bucket's gathered ``out``; ``k`` is
        its place in ``b``."""
        c, off = self.chunk[i], b.offsets[k]
        return out.view(self.replicas, b.size)[:, off:off + c].reshape(-1)[:self.numel[i]]


class ZeroShards:
    """The optimizer of a replicated stage under ZeRO ``place`` (module docstring); in
    the place of :class:`~.precision.MasterWeights`, with its interface: ``optimizer``,
    ``masters`` (here the chunk parameters), ``step``, ``state`` and ``load``.

    :meth:`bind` gives it the stage's replica group before the first step.
    """

    #: Whether the full weights are freed between uses (level 3, :mod:`.zero_params`).
    frees_weights = False

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter],
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 precision: Precision, place: ZeroPlace, stage: int) -> None:
        if any(hasattr(p, "_local_tensor") for p in params):
            raise ConfigError(f"zero={place.level} on stage {stage}, which is split over "
                              "workers (tensor_parallel > 1), is not supported; use zero=0 "
                              "there", "zero")
        self.place, self.level, self._stage = place, place.level, stage
        self._params = list(params)
        self.copies = precision.master_weights
        #: Whether a chunk parameter is a view of the live weights (32 bits, levels 1-2).
        self.views = not self.copies and not self.frees_weights
        lay = _Layout(self._params, place, 0.0)  # the chunks; buckets once in their dtype
        self.masters: list[nn.Parameter] = [
            nn.Parameter(lay.shard(i, p.detach().reshape(-1)).float().clone() if self.copies
                         else lay.shard(i, p.detach().view(-1)) if self.views
                         else lay.shard(i, p.detach().view(-1)).clone())
            for i, p in enumerate(self._params)]
        if self.copies:
            module.to(precision.param_dtype)
        self.layout = _Layout(self._params, place, buckets_module.BUCKET_CAP_MB)
        self.optimizer = optimizer(self.masters) if self._params else None
        self.group: Any = None
        self._wait: Wait | None = None
        self._grads: list[Tensor] | None = None  # level 2: this replica's summed chunks

    @property
    def gathers_state(self) -> bool:
        """Whether :meth:`state` is a collective over the replicas (each holds its chunks
        of the weights at the optimizer's precision only)."""
        return not self.views

    @property
    def shards_gradients(self) -> bool:
        """Whether the gradients are sharded too (level 2): a replica holds its chunks."""
        return self.level >= 2

    def bind(self, group: Any, wait: Wait) -> None:
        """The stage's replica ``group`` (ranks in replica order) and how to wait for a
        collective on it (the runner's, with the run's deadline)."""
        if group is None or dist.get_world_size(group) != self.place.replicas:
            raise ConfigError(
                f"zero={self.level} on stage {self._stage}: its replica group has "
                f"{1 if group is None else dist.get_world_size(group)} ranks, the "
                f"plan {self.place.replicas}", "zero")
        if dist.get_rank(group) != self.place.replica:
            raise ValueError(f"this rank is replica {dist.get_rank(group)} of stage "
                             f"{self._stage}'s group, not {self.place.replica}")
        self.group, self._wait = group, wait

    def check_tie(self) -> None:
        """Refuse a tied weight at level 2: its tie sums full gradients across stages."""
        if self.shards_gradients:
            raise ConfigError(
                f"zero={self.level} with weights tied across stages (stage {self._stage}) "
                "is not supported: the tie sums full gradients, which level 2 does not "
                "keep; use zero=1", "zero")

    # ---- gradients (level 2) ---------------------------------------------
    def take_gradients(self, grads: list[Tensor]) -> None:
        """This replica's chunks of the summed gradient, by parameter (a reduce-scatter's)."""
        self._grads = grads

    def gradients(self) -> list[Tensor]:
        """The gradient chunks this replica holds (level 2), by parameter; empty ones where
        the update's reduce-scatter has not run: none."""
        return [] if self._grads is None else self._grads

    def drop(self) -> None:
        """A skipped update: its gradient chunks go."""
        self._grads = None

    # ---- update ----------------------------------------------------------
    def step(self, grads: Sequence[Tensor | None]) -> None:
        """One optimizer step on this replica's chunks, then the all-gather of the new
        weights (level 3: at the next ``UNSHARD``). ``grads``: the full summed gradients
        (level 1; None: none came); at levels 2 and 3 the chunks :meth:`take_gradients`
        took."""
        if self.optimizer is None:
            return
        lay = self.layout
        if self.views:  # the live weights may have moved to a fresh copy (versions)
            for i, (m, p) in enumerate(zip(self.masters, self._params, strict=True)):
                m.data = lay.shard(i, p.detach().view(-1))
        chunks: Sequence[Tensor | None]
        if self.shards_gradients:
            assert self._grads is not None, "level 2 steps after the update's reduce-scatter"
            chunks, self._grads = self._grads, None
        else:
            chunks = [None if g is None else lay.shard(i, g.reshape(-1))
                      for i, g in enumerate(grads)]
        for m, g in zip(self.masters, chunks, strict=True):
            m.grad = None if g is None else (g.float() if self.copies else g)
        self.optimizer.step()
        for m in self.masters:
            m.grad = None
        if not self.frees_weights:
            self._all_gather(Action(ActionKind.STEP, self._stage, 0))

    def _all_gather(self, action: Action) -> None:
        """Every replica's chunks into the full parameters (in their dtype: a bf16
        stage's rounding of its masters, as :class:`~.precision.MasterWeights` rounds);
        ``action`` names the wait in a timeout's message."""
        lay, started = self.layout, []
        for b in lay.buckets:
            shards = [self.masters[i].detach().to(b.dtype) for i in b.indices]
            started.append((b, *lay.gather(b, shards, self.group)))
        with torch.no_grad():
            for b, out, work in started:
                self._waited(work, action)
                for k, i in enumerate(b.indices):
                    self._params[i].view(-1).copy_(lay.whole(i, out, b, k))

    def _waited(self, work: Any, action: Action) -> None:
        if self._wait is None:
            raise RuntimeError(f"stage {self._stage}'s ZeRO shards were never bound to "
                               "their replica group (ZeroShards.bind)")
        self._wait(work, action)

    # ---- state -----------------------------------------------------------
    def _gather_one(self, i: int, shard: Tensor) -> Tensor:
        """Parameter ``i``'s full tensor of which every replica holds ``shard`` (blocking)."""
        c = self.layout.chunk[i]
        send = torch.zeros(c, dtype=shard.dtype, device=shard.device)
        send[:shard.numel()] = shard.detach()
        out = torch.empty(c * self.place.replicas, dtype=shard.dtype, device=shard.device)
        self._waited(dist.all_gather_single(out, send, group=self.group, async_op=True),
                     Action(ActionKind.STEP, self._stage, 0))
        return out[:self.layout.numel[i]].view(self._params[i].shape)

    def state(self, module: nn.Module) -> dict[str, Tensor]:
        """``module``'s state, each parameter at the optimizer's precision, whole (the
        masters gathered: a collective over the replicas, which all call it)."""
        state = module.state_dict(keep_vars=True)
        if self.views:
            return {k: v.detach() for k, v in state.items()}
        full = {id(p): self._gather_one(i, m)
                for i, (p, m) in enumerate(zip(self._params, self.masters, strict=True))}
        return {k: full.get(id(v), v).detach() for k, v in state.items()}

    def load(self, state: Mapping[str, Tensor], names: Sequence[str]) -> None:
        """Take this replica's chunks of the masters from ``state`` (whole tensors by name;
        the module has loaded them)."""
        if self.views:
            return
        with torch.no_grad():
            for i, (m, name) in enumerate(zip(self.masters, names, strict=True)):
                m.copy_(self.layout.shard(i, state[name].reshape(-1)))

    def gathered_state(self, i: int, per: Mapping[str, Any]) -> dict[str, Any]:
        """Parameter ``i``'s optimizer state with each chunk-shaped tensor made whole
        (a collective: every replica calls it for the same ``i``)."""
        shape = self.masters[i].shape
        return {k: self._gather_one(i, v) if isinstance(v, Tensor) and v.dim() == 1
                and v.shape == shape else v for k, v in per.items()}

    def sharded_state(self, i: int, per: Mapping[str, Any]) -> dict[str, Any]:
        """Parameter ``i``'s whole optimizer state (a checkpoint's) as this replica keeps
        it: each parameter-shaped tensor cut to its chunk."""
        shape, m = self._params[i].shape, self.masters[i]
        return {k: self.layout.shard(i, v.reshape(-1)).to(m.dtype).clone()
                if isinstance(v, Tensor) and v.dim() >= 1 and v.shape == shape else v
                for k, v in per.items()}


class ShardBuckets:
    """Level 2's :class:`~.buckets.GradientBuckets`: the same buckets, started as the
    backward finishes them, but each a reduce-scatter; :meth:`finish` gives
    ``shards`` this replica's chunks of the sums, scaled."""

    def __init__(self, shards: ZeroShards, wait: Wait) -> None:
        self._shards = shards
        self._wait = wait
        self._layout = shards.layout
        self._reset()

    @property
    def sizes(self) -> list[int]:
        """The number of parameters in each bucket, in launch order."""
        return [len(b.indices) for b in self._layout.buckets]

    def _reset(self) -> None:
        self._got: list[list[Tensor | None]] = [[None] * len(b.indices)
                                                for b in self._layout.buckets]
        self._missing = [len(b.indices) for b in self._layout.buckets]
        self._started: list[tuple[Tensor, Tensor, Any]] = []

    def ready(self, index: int, grad: Tensor) -> None:
        """Gradient ``index`` is final: start every bucket that can now start, in order."""
        b, k = self._layout.where[index]
        if self._got[b][k] is None:
            self._missing[b] -= 1
        self._got[b][k] = grad
        buckets = self._layout.buckets
        while len(self._started) < len(buckets) and self._missing[len(self._started)] == 0:
            n = len(self._started)
            grads = [g for g in self._got[n] if g is not None]
            buf = self._layout.scatter_input(buckets[n], grads)
            out = torch.empty(buckets[n].size, dtype=buf.dtype, device=buf.device)
            work = dist.reduce_scatter_single(out, buf, group=self._shards.group,
                                              async_op=True)
            self._started.append((buf, out, work))
            self._got[n] = [None] * len(grads)  # the full gradients are not kept here

    def finish(self, grads: Sequence[Tensor], action: Action, scale: float) -> None:
        """Sum the gradients over the replicas, keeping this replica's chunks, times
        ``scale``; those not reported ready are taken from ``grads``."""
        lay = self._layout
        try:
            for b, bucket in enumerate(lay.buckets):
                if b < len(self._started):
                    continue
                for k, i in enumerate(bucket.indices):
                    if self._got[b][k] is None:
                        self.ready(i, grads[i])
            chunks: list[Tensor | None] = [None] * len(lay.numel)
            for bucket, (_, out, work) in zip(lay.buckets, self._started, strict=True):
                self._wait(work, action)
                if scale != 1.0:
                    out.mul_(scale)
                for i, off in zip(bucket.indices, bucket.offsets, strict=True):
                    chunks[i] = out[off:off + lay.hi[i] - lay.lo[i]]
            self._shards.take_gradients([c for c in chunks if c is not None])
        finally:
            self._reset()


def stage_buckets(shards: ZeroShards | None, params: Sequence[Tensor], group: Any,
                  wait: Wait) -> GradientBuckets | ShardBuckets:
    """What a runner's ``ALLREDUCE`` finishes for a stage with ``shards`` (None: no ZeRO):
    reduce-scatters at level 2, all-reduces otherwise; binds ``shards`` to ``group``."""
    if shards is None:
        return GradientBuckets(params, group, wait)
    shards.bind(group, wait)
    return ShardBuckets(shards, wait) if shards.shards_gradients else GradientBuckets(
        params, group, wait)


"""ZeRO for a replicated stage: each of its ``r`` replicas keeps 1/r of the optimizer's state.

The rule (Rajbhandari et al. 2020): every parameter, flattened, is cut into ``r`` contiguous
chunks of ``ceil(n / r)`` values (the last ones shorter, maybe empty); replica ``k`` owns
chunk ``k`` of each. **Level 1**: the gradients are all-reduced as without ZeRO
(:mod:`.buckets`); the optimizer, built by the user's factory on one 1-D ``nn.Parameter``
per parameter (its chunk), steps only this replica's chunks; an all-gather then puts the
updated chunks back into the full parameters. **Level 2**: each microbatch's gradient is
reduce-scattered instead, by bucket as its backward ends, into this replica's chunks
(:mod:`.zero_buckets`); level 3 (:mod:`.zero_params`) frees the weights between uses.

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

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dreampipe.errors import ConfigError
from dreampipe.runtime import buckets as buckets_module
from dreampipe.runtime.buckets import Wait
from dreampipe.runtime.precision import Precision, optimizer_over
from dreampipe.scheduling.actions import Action, ActionKind

__all__ = ["MAX_LEVEL", "ZeroPlace", "ZeroShards"]

#: The highest level: 3, parameters sharded between uses (:mod:`.zero_params`).
MAX_LEVEL = 3

_log = logging.getLogger(__name__)


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
    ``offset[i]`` of the bucket's per-replica stretch of ``size`` values; a ``tagged`` one
    ends each stretch with :data:`_TAG` values naming its first parameter."""

    indices: list[int]
    offsets: list[int]
    size: int
    dtype: torch.dtype
    tagged: bool = False


#: Values at the end of each replica's stretch of a gather per use: its first parameter's
#: index, base 256 (exact in every float format), which every replica's must match.
_TAG = 2


class _Layout:
    """Where each parameter's chunks lie (module docstring), and the buckets: consecutive
    parameters in reverse order up to a cap, of one dtype, a parameter of the cap or more
    alone (its reduce-scatter then reads its gradient as it lies)."""

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
            nbytes = params[i].numel() * params[i].element_size()
            if (last is None or size >= cap or last.dtype != params[i].dtype
                    or (nbytes >= cap and last.indices)):  # a large one alone: no copy
                last = _Bucket([], [], 0, params[i].dtype)
                self.buckets.append(last)
                size = 0.0
            self.where[i] = (len(self.buckets) - 1, len(last.indices))
            last.indices.append(i)
            last.offsets.append(last.size)
            last.size += self.chunk[i]
            size += nbytes

    def shard(self, i: int, flat: Tensor) -> Tensor:
        """This replica's chunk of parameter ``i``'s values ``flat`` (1-D), a view."""
        return flat[self.lo[i]:self.hi[i]]

    def put(self, buf: Tensor, b: _Bucket, k: int, grad: Tensor) -> None:
        """Copy ``grad``, the gradient of ``b``'s ``k``-th parameter, into ``buf``, the
        bucket's reduce-scatter input (``(replicas, b.size)``, zeros where no chunk lies):
        replica ``j``'s row gets chunk ``j``."""
        i, off = b.indices[k], b.offsets[k]
        flat, c = grad.reshape(-1), self.chunk[i]
        for j in range(self.replicas):
            part = flat[j * c:(j + 1) * c]
            buf[j, off:off + part.numel()] = part

    def gather(self, b: _Bucket, shards: Sequence[Tensor], group: Any,
               out: Tensor | None = None) -> tuple[Tensor, Any]:
        """Start the all-gather of ``shards`` (this replica's chunks, in ``b.indices`` order):
        the output, ``(replicas, b.size)`` once the returned work is done, into ``out``
        (1-D) if given."""
        send = torch.zeros(b.size, dtype=b.dtype, device=shards[0].device if shards else None)
        for off, s in zip(b.offsets, shards, strict=True):
            send[off:off + s.numel()] = s
        if b.tagged:
            send[-_TAG:] = torch.tensor(_tag(b), dtype=b.dtype)
        if out is None:
            out = torch.empty(self.replicas * b.size, dtype=b.dtype, device=send.device)
        return out, dist.all_gather_single(out, send, group=group, async_op=True)

    def unit(self, indices: Sequence[int], dtype: torch.dtype) -> _Bucket:
        """A bucket of parameters ``indices`` alone, in that order, tagged (one collective
        for weights gathered together, :mod:`.zero_params`)."""
        offsets = [0]
        for i in indices:
            offsets.append(offsets[-1] + self.chunk[i])
        return _Bucket(list(indices), offsets[:-1], offsets[-1] + _TAG, dtype, tagged=True)

    def tags_differ(self, out: Tensor, b: _Bucket) -> Tensor:
        """For a tagged bucket's gathered ``out``: whether some replica gathered other
        weights than the others, as a tensor on ``out``'s device (read it once an update:
        reading it at each gather would wait for the device)."""
        tags = out.view(self.replicas, b.size)[:, -_TAG:]
        return (tags != tags[:1]).any()

    def lies_whole(self, b: _Bucket) -> bool:
        """Whether bucket ``b``'s gathered output is its one parameter's values as they
        lie: a single parameter that splits evenly into the replicas' chunks."""
        return (len(b.indices) == 1 and not b.tagged
                and self.numel[b.indices[0]] == self.replicas * b.size)

    def copy_whole(self, i: int, out: Tensor, b: _Bucket, k: int, dest: Tensor) -> None:
        """Write parameter ``i``'s full values from its bucket's gathered ``out`` into
        ``dest`` (1-D), row by row of the replicas' chunks: no whole copy between."""
        c, off, n = self.chunk[i], b.offsets[k], self.numel[i]
        rows = out.view(self.replicas, b.size)[:, off:off + c]
        full, rest = divmod(n, c) if c else (0, 0)
        if full:
            dest[:full * c].view(full, c).copy_(rows[:full])
        if rest:
            dest[full * c:].copy_(rows[full, :rest])

    def whole(self, i: int, out: Tensor, b: _Bucket, k: int) -> Tensor:
        """Parameter ``i``'s full values (1-D) from its bucket's gathered ``out``; ``k`` is
        its place in ``b``."""
        c, off = self.chunk[i], b.offsets[k]
        return out.view(self.replicas, b.size)[:, off:off + c].reshape(-1)[:self.numel[i]]


def _tag(b: _Bucket) -> tuple[float, float]:
    """Bucket ``b``'s tag: its first parameter's index, base 256 (module ``_TAG``)."""
    high, low = divmod(b.indices[0] % 65536, 256)
    return float(high), float(low)


#: Optimizers that step each value on its own, so that stepping a chunk steps those
#: values as stepping the whole tensor would (module docstring).
_ELEMENTWISE = frozenset(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
    "Rprop", "ASGD"))
_ELEMENTWISE_NAMES = ", ".join(sorted(t.__name__ for t in _ELEMENTWISE))


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
        self.optimizer = (optimizer_over(optimizer, self._params, self.masters)
                          if self._params else None)
        if self.optimizer is not None and type(self.optimizer) not in _ELEMENTWISE:
            _log.warning("zero=%d on stage %d: %s steps each replica's 1-D chunk of a "
                         "parameter and is not known to step each value alone (as %s); one "
                         "that looks across a tensor (LAMB, Adafactor, Muon) then makes "
                         "another update than without ZeRO: use zero=0 for it", self.level,
                         stage, type(self.optimizer).__name__, _ELEMENTWISE_NAMES)
        self.group: Any = None
        self._wait: Wait | None = None
        self._grads: list[Tensor] | None = None  # level 2: this replica's summed chunks
        self._unused: frozenset[int] = frozenset()  # level 2: no replica's use gave these one

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

    # ---- gradients (level 2) ---------------------------------------------
    @property
    def stage(self) -> int:
        """The stage these are the shards of."""
        return self._stage

    def take_gradients(self, grads: list[Tensor]) -> None:
        """This replica's chunks of the update's summed gradient, by parameter."""
        self._grads = grads

    def no_gradient(self, indices: Iterable[int]) -> None:
        """No replica's microbatches used these parameters this update: their chunks
        (zeros) step as no gradient, as in one process (level 2)."""
        self._unused = frozenset(indices)

    def gradients(self) -> list[Tensor]:
        """The gradient chunks this replica holds (level 2), by parameter; none before the
        update's ``ALLREDUCE``."""
        return [] if self._grads is None else self._grads

    def drop(self) -> None:
        """A skipped update: its gradient chunks go."""
        self._grads, self._unused = None, frozenset()

    def has_gradient(self, i: int) -> bool:
        """Whether some replica's microbatches gave parameter ``i`` a gradient (level 2)."""
        return i not in self._unused

    def whole_gradient(self, i: int) -> Tensor:
        """Parameter ``i``'s summed gradient, whole, from every replica's chunk (level 2; a
        collective over the replicas): what a weight tied across stages adds up."""
        assert self._grads is not None, "a tie sums the gradient after the ALLREDUCE"
        return self._gather_one(i, self._grads[i])

    def keep_gradient(self, i: int, whole: Tensor | None) -> None:
        """Keep this replica's chunk of ``whole``, parameter ``i``'s gradient (level 2;
        None: no gradient, its chunk of zeros steps as none)."""
        assert self._grads is not None
        if whole is None:
            self._unused |= {i}
            return
        self._grads[i] = self.layout.shard(i, whole.reshape(-1)).clone()
        self._unused -= {i}

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
            chunks = [None if i in self._unused else g for i, g in enumerate(self._grads)]
            self._grads, self._unused = None, frozenset()
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
        lay, flying = self.layout, []
        for b in lay.buckets:  # two buckets at a time: a gather's output is whole weights
            shards = [self.masters[i].detach().to(b.dtype) for i in b.indices]
            p = self._params[b.indices[0]]
            direct = lay.lies_whole(b) and p.is_contiguous()
            flying.append((b, *lay.gather(b, shards, self.group,
                                          p.detach().view(-1) if direct else None), direct))
            if len(flying) > 1:
                self._gathered(*flying.pop(0), action)
        for f in flying:
            self._gathered(*f, action)

    def _gathered(self, b: _Bucket, out: Tensor, work: Any, direct: bool,
                  action: Action) -> None:
        """Wait for bucket ``b``'s all-gather; copy its values into the parameters unless
        it wrote them ``direct``."""
        self._waited(work, action)
        if direct:
            return
        with torch.no_grad():
            for k, i in enumerate(b.indices):
                self.layout.copy_whole(i, out, b, k, self._params[i].view(-1))

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
                if name in state:
                    m.copy_(self.layout.shard(i, state[name].reshape(-1)))

    def gathered_state(self, i: int, per: Mapping[str, Any]) -> dict[str, Any]:
        """Parameter ``i``'s optimizer state with each chunk-shaped tensor made whole
        (a collective: every replica calls it for the same ``i``)."""
        shape = self.masters[i].shape
        return {k: self._gather_one(i, v) if isinstance(v, Tensor) and v.dim() == 1
                and v.shape == shape else v for k, v in per.items()}

    def sharded_state(self, i: int, per: Mapping[str, Any]) -> dict[str, Any]:
        """Parameter ``i``'s whole optimizer state (a checkpoint's) as this replica keeps
        it: each parameter-shaped tensor cut to its chunk. A 0-dim parameter's state is
        0-dim too, as its step count is: every such tensor but ``step`` is cut."""
        shape, m = self._params[i].shape, self.masters[i]
        return {k: self.layout.shard(i, v.reshape(-1)).to(m.dtype).clone()
                if isinstance(v, Tensor) and v.shape == shape and (v.dim() >= 1 or k != "step")
                else v for k, v in per.items()}

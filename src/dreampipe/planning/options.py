"""``PlanOptions``: what :func:`~dreampipe.planning.planner.plan_pipeline` may do, in one record.

Frozen and checked when made, so a bad option fails before any search. The
rules that need the model (``max_stages`` against its layer count) are the
planner's. :meth:`PlanOptions.search` gives the dynamic program's own
:class:`~dreampipe.planning.level.Options` for a model of ``n`` layers.
See docs/planner.md for what each option changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from dreampipe.errors import ConfigError
from dreampipe.planning.costs import CostModel
from dreampipe.planning.level import Options
from dreampipe.planning.memory_terms import STATELESS, OptimizerTerms
from dreampipe.planning.sync import DEFAULT_SYNC, Sync

__all__ = ["PlanOptions"]


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """The planner's options (defaults: PipeDream's optimizer's, without a memory limit).

    ``memory_bytes`` rejects stages that do not fit (None: no limit); ``straight``
    forbids replication; ``allow_fewer_workers`` lets idle workers stay idle when
    that is faster; ``max_stages`` caps the stages of the flattened plan;
    ``also_flat`` also solves the one-level problem at the slowest link and keeps
    it when faster; ``cost_model`` picks the terms (``PIPEDREAM`` plans as
    PipeDream's optimizer does, so it ignores ``also_flat``, ``allow_fewer_workers``
    and ``sync``); ``sync`` is the all-reduce of replicated stages;
    ``tensor_split`` lets a model no layer plan fits run as one stage split over
    workers of a server; ``exact`` searches every layer however long it takes;
    ``recompute`` lets a stage recompute its activations where only that fits;
    ``mixed_splits`` makes a tensor split a per-stage choice of the range search;
    ``optimizer`` is what the optimizer holds beside every stage's weights and gradient
    (:class:`~dreampipe.planning.memory_terms.OptimizerTerms`: its state, its step's
    temporaries).
    """

    memory_bytes: int | None = None
    straight: bool = False
    allow_fewer_workers: bool = True
    max_stages: int | None = None
    also_flat: bool = True
    cost_model: CostModel = CostModel.DREAMPIPE
    sync: Sync = DEFAULT_SYNC
    tensor_split: bool = True
    exact: bool = False
    recompute: bool = False
    mixed_splits: bool = False
    optimizer: OptimizerTerms = STATELESS

    def __post_init__(self) -> None:
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ConfigError(f"memory_bytes={self.memory_bytes} must be positive, e.g. 16e9 "
                              "for 16 GB", "memory_bytes")
        if self.memory_bytes is not None and self.cost_model is CostModel.PIPEDREAM:
            raise ConfigError(
                f"memory_bytes={self.memory_bytes}: the pipedream cost model reproduces "
                "PipeDream's optimizer without a memory limit; drop --memory or use "
                "--cost-model dreampipe", "memory_bytes")
        if self.sync != DEFAULT_SYNC and self.cost_model is CostModel.PIPEDREAM:
            raise ConfigError(
                f"sync={self.sync.kind.value}: the pipedream cost model prices PipeDream's "
                "own all-reduce, whatever the algorithm; drop --sync and --ps-shards or use "
                "--cost-model dreampipe", "sync")

    def search(self, layers: int) -> Options:
        """The dynamic program's options for a model of ``layers`` layers."""
        pipedream = self.cost_model is CostModel.PIPEDREAM
        return Options(self.memory_bytes, self.straight,
                       self.allow_fewer_workers and not pipedream,
                       _slots(self.max_stages, layers), self.max_stages is not None,
                       self.cost_model, self.sync)


def _slots(max_stages: int | None, layers: int) -> int:
    """The DP's stage-count slots: ``max_stages``, or 1 for no limit."""
    if max_stages is None:
        return 1
    if not 1 <= max_stages <= layers:
        raise ConfigError(
            f"max_stages={max_stages} is impossible for a model of {layers} layers; "
            f"use 1..{layers} (a stage holds at least one layer)", "max_stages"
        )
    return max_stages

"""One pipeline stage of a :class:`~dreampipe.planning.plan.Plan`: its layers, replicas,
split, recomputation and the planner's predictions for it, checked on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dreampipe.errors import PlanError
from dreampipe.planning.splits import Split

__all__ = ["Stage", "check_figure"]


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One pipeline stage. Times are per minibatch, for the whole stage.

    ``compute_s`` is forward+backward of the stage's layers for one minibatch
    on one worker; ``comm_s`` is the time to send its output forward and the
    gradient back across the cut after it; ``allreduce_s`` the time of one
    all-reduce of its weights among its replicas, which ends
    ``allreduce_delay_s`` later than if it could start with the backward
    (gradients become final layer by layer); ``forward_s`` the forward
    part of ``compute_s`` (the all-reduce can only hide behind the rest);
    ``memory_bytes`` the predicted peak per worker (weights x stashed
    versions + activations). ``workers`` are the topology positions of
    ``ranks``, in the same order (of a split replica, its first worker; empty:
    laid in rank order, :meth:`~dreampipe.planning.plan.Plan.stage_workers`).
    ``tensor_parallel`` consecutive workers of one server run each replica, with
    ``splits`` (one per layer) saying how each layer's tensors are divided among them.
    ``in_flight`` is the minibatches each replica holds under PipeDream's
    schedule, its 1F1B warm-up (0: the default of
    :mod:`dreampipe.planning.in_flight`). ``recompute``: the backward runs
    the stage's forward again (counted in ``compute_s``) instead of keeping
    what its layers keep for every minibatch in flight. ``zero``: the ZeRO level its
    replicas shard at (docs/design.md §5.6); None takes the run's (``TrainConfig.zero``).
    ``shared_link_s``: the busiest server link the cut after it uses, with what the
    other cuts put on it (docs/design.md §3.4); the cut takes at least that.
    ``loop_s``: its slowest 1F1B loop per minibatch with the unreplicated stages after it
    (:func:`~dreampipe.planning.in_flight.loop_seconds`); the stage takes at least that.
    """

    first: int
    last: int
    replicas: int
    ranks: tuple[int, ...]
    compute_s: float = 0.0
    comm_s: float = 0.0
    allreduce_s: float = 0.0
    memory_bytes: int = 0
    forward_s: float = 0.0
    workers: tuple[int, ...] = ()
    allreduce_delay_s: float = 0.0
    tensor_parallel: int = 1
    splits: tuple[Split, ...] = ()
    in_flight: int = 0
    recompute: bool = False
    zero: int | None = None
    shared_link_s: float = 0.0
    loop_s: float = 0.0

    def __post_init__(self) -> None:
        if self.first < 0 or self.last < self.first:
            raise PlanError(f"stage layers {self.first}..{self.last} are empty or negative")
        if self.zero is not None and not 0 <= self.zero <= 3:
            raise PlanError(f"stage {self.first}..{self.last} has zero={self.zero}; give 0, 1, "
                            "2 or 3 (or none: the run's)")
        if self.replicas < 1:
            raise PlanError(
                f"stage {self.first}..{self.last} has {self.replicas} replicas; needs >= 1"
            )
        if len(self.ranks) != self.replicas:
            raise PlanError(
                f"stage {self.first}..{self.last} has {self.replicas} replicas "
                f"but ranks {list(self.ranks)}"
            )
        if self.workers and len(self.workers) != self.replicas:
            raise PlanError(
                f"stage {self.first}..{self.last} has {self.replicas} replicas "
                f"but workers {list(self.workers)}"
            )
        if self.tensor_parallel < 1 or (self.tensor_parallel > 1) != bool(self.splits) or (
                self.splits and len(self.splits) != self.num_layers):
            raise PlanError(
                f"stage {self.first}..{self.last} has tensor_parallel={self.tensor_parallel} "
                f"and {len(self.splits)} splits; a stage split over t > 1 workers needs one "
                f"split per layer ({self.num_layers}), one over 1 worker none"
            )
        for what in ("compute_s", "comm_s", "allreduce_s", "memory_bytes", "forward_s",
                     "allreduce_delay_s", "shared_link_s", "loop_s"):
            check_figure(f"stage {self.first}..{self.last}", what, getattr(self, what))
        if self.forward_s > self.compute_s:
            raise PlanError(
                f"stage {self.first}..{self.last} has forward_s={self.forward_s} above "
                f"compute_s={self.compute_s}; the forward is part of forward+backward"
            )

    @property
    def placement(self) -> tuple[int, ...]:
        """Where the stage's replicas sit on the topology: ``workers``, else ``ranks``."""
        return self.workers or self.ranks

    @property
    def num_layers(self) -> int:
        return self.last - self.first + 1

    @property
    def time_s(self) -> float:
        """Time per minibatch in steady state: ``max(C, F + delay + allreduce) / r``, or the
        cut (its own time, or the server link it shares), or its loop with the next stage.

        Each replica runs one minibatch per round; the round's all-reduce
        overlaps the backward (``C - F``) after its delay, never the forward.
        """
        round_s = max(self.compute_s,
                      self.forward_s + self.allreduce_delay_s + self.allreduce_s)
        return max(round_s / self.replicas, self.comm_s, self.shared_link_s, self.loop_s)


def check_figure(owner: str, what: str, value: float) -> None:
    """A predicted time or size must be a finite number >= 0."""
    try:
        ok = math.isfinite(value) and value >= 0
    except TypeError:
        ok = False
    if not ok:
        raise PlanError(
            f"{owner} has {what}={value!r}; predicted times and sizes must be finite and "
            ">= 0 (re-run 'dreampipe plan' on a profile with finite times and sizes)"
        )

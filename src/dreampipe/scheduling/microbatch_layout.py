"""How a weight update is cut into scheduled microbatches, and every size that follows.

A run trains ``steps`` weight updates of ``minibatch_size`` samples each. The
``microbatch`` of every :class:`~dreampipe.scheduling.actions.Action` is one piece
of an update, and the piece depends on the schedule::

    schedule                microbatches per update            samples per microbatch
    pipedream               1 (a microbatch is a minibatch)   minibatch_size
    the other pipelines     microbatches                minibatch_size / microbatches
    dp on N workers         N * microbatches            minibatch_size / (N * microbatches)

so for ``dp`` the ``microbatches`` count is *per worker* (gradient
accumulation on each worker), and every worker gets the same share. Microbatch
``u`` holds samples ``u*size .. (u+1)*size-1`` of the data stream, so the same
run split into more microbatches sees the same samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dreampipe.errors import ConfigError
from dreampipe.scheduling.actions import Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule, whole_rounds

__all__ = ["MicrobatchLayout", "default_microbatches"]


def default_microbatches(replicas: Sequence[int]) -> int:
    """The microbatches a minibatch is cut into when none are asked: GPipe's four per
    stage, rounded up to whole rounds of the widest stage's replicas, so that no replica
    of it sits out the minibatch (one stage on 8 replicas: 8, as data parallelism)."""
    from dreampipe.planning.costs import GPIPE_MICROBATCHES_PER_STAGE  # NumPy: when used

    widest = max(replicas, default=1)
    return -(-GPIPE_MICROBATCHES_PER_STAGE * len(replicas) // widest) * widest


@dataclass(frozen=True, kw_only=True)
class MicrobatchLayout:
    """The table above for one run; checked when made, so every size it gives is whole.

    ``minibatch_size`` None leaves sample counts out: the simulator counts in
    profiled minibatches and asks only for :attr:`microbatch_fraction`.
    """

    kind: ScheduleKind
    minibatch_size: int | None = None
    microbatches: int = 1
    workers: int = 1

    def __post_init__(self) -> None:
        for name in ("minibatch_size", "microbatches", "workers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value}; use 1 or more", name)
        if self.kind is ScheduleKind.PIPEDREAM and self.microbatches != 1:
            raise ConfigError(
                f"microbatches={self.microbatches} with schedule=pipedream: PipeDream updates "
                "after every minibatch; use microbatches=1 or a synchronous schedule "
                "(1f1b-flush) to split minibatches",
                "microbatches", "schedule",
            )
        size, microbatches = self.minibatch_size, self.microbatches_per_update
        if size is not None and size % microbatches:
            raise ConfigError(self._indivisible(size, microbatches), "minibatch_size",
                              "microbatches")

    def _indivisible(self, size: int, microbatches: int) -> str:
        what = f"microbatches={self.microbatches}"
        # dp's knob is per worker: the counts it can take make whole microbatches on each
        each = self.workers if self.kind is ScheduleKind.DP else 1
        if each > 1:
            what = f"{self.workers} workers x {what} = {microbatches} microbatches"
        divisors = [d for d in range(2 if each == 1 else 1, size // each + 1)
                    if size % (d * each) == 0]
        near = sorted(sorted(divisors, key=lambda d: (d < self.microbatches,
                                                      abs(d - self.microbatches)))[:2])
        split = "" if not near else (
            f", or microbatches={' or '.join(str(d) for d in near)}" if each > 1 else
            f", or split it into {' or '.join(str(d) for d in near)} microbatches")
        return (f"minibatch_size={size} is not divisible by {what}; use a multiple of "
                f"{microbatches} samples per update{split}")

    @property
    def microbatches_per_update(self) -> int:
        """Scheduled microbatches per weight update (the table above)."""
        if self.kind is ScheduleKind.PIPEDREAM:
            return 1
        if self.kind is ScheduleKind.DP:
            return self.microbatches * self.workers
        return self.microbatches

    @property
    def microbatch_size(self) -> int:
        """Samples per microbatch (minibatch or microbatch)."""
        if self.minibatch_size is None:
            raise ConfigError("minibatch_size is not set: this layout counts microbatches only",
                              "minibatch_size")
        return self.minibatch_size // self.microbatches_per_update

    @property
    def microbatch_fraction(self) -> float:
        """A microbatch's share of one worker's minibatch: 1 for pipedream, else 1/microbatches.

        A dp worker's minibatch is its share of the update, so ``dp`` with one
        microbatch runs one whole minibatch per worker per update.
        """
        return 1.0 if self.kind is ScheduleKind.PIPEDREAM else 1.0 / self.microbatches

    def num_microbatches(self, steps: int) -> int:
        """Microbatches in ``steps`` weight updates."""
        return steps * self.microbatches_per_update

    def updates_covering(self, worker_minibatches: int) -> int:
        """The fewest updates that run ``worker_minibatches`` minibatches, shared by the workers."""
        per = self.workers if self.kind is ScheduleKind.DP else 1
        return -(-worker_minibatches // per)

    def whole_rounds(self, replicas: Sequence[int], steps: int) -> int:
        """``steps`` rounded up to whole all-reduce rounds (pipedream's replicated stages).

        :meth:`build` takes any ``steps`` (the last round may be partial); this is
        for a run whose every update should average a whole round, as training's.
        """
        if self.kind is not ScheduleKind.PIPEDREAM:
            return steps
        return whole_rounds(replicas, steps)

    def build(
        self, replicas: Sequence[int], steps: int, in_flight: Sequence[int] | None = None,
        virtual_stages: int = 1, zero: Sequence[int] | None = None, steps_agree: bool = False,
    ) -> Schedule:
        """The validated schedule of ``steps`` updates over stages replicated ``replicas`` ways.

        ``in_flight`` (a plan's :attr:`~dreampipe.planning.plan.Plan.in_flight`)
        sets the pipedream schedule's warm-up; the synchronous ones have their own.
        ``virtual_stages``: stages per worker, for interleaved-1f1b. ``zero``: each stage's
        ZeRO level (level 3 gathers and frees a replicated stage's weights, :mod:`.unshard`).
        ``steps_agree``: every rank waits for every other at each update (2bw then keeps
        its steps after each minibatch, :func:`~dreampipe.scheduling.updates.defers_steps`).
        """
        pipedream = self.kind is ScheduleKind.PIPEDREAM
        return build_schedule(replicas, self.kind, self.num_microbatches(steps),
                              self.microbatches_per_update,
                              in_flight if pipedream else None, virtual_stages, zero,
                              steps_agree)

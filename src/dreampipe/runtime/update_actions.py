"""A rank's weight updates: what its ``ALLREDUCE`` and ``STEP`` actions do.

``ALLREDUCE<k>`` waits for the round's gradient buckets (:mod:`.buckets`) and applies
the scale; where the schedule defers ``STEP<k>`` (2bw,
:func:`~dreampipe.scheduling.updates.launched_rounds`) it launches them and the ``STEP``
waits. ``STEP<k>`` applies the update to the live weights
(:meth:`~dreampipe.runtime.stage_module.StageModule.step`) after two all-reduces over
every rank: whether any stage saw a non-finite value (:mod:`.nonfinite`, the update
skipped) and, with ``max_grad_norm``, the global gradient norm to clip by, which the sums
of the weights tied across stages (:mod:`.stage_ties`) precede. Those run once per
update on each rank, at its first ``STEP`` of the update, for all its stages (several
under interleaving, whose update pass puts every ``ALLREDUCE`` before that ``STEP``).

Loss scaling: in the synchronous schedules each microbatch's mean loss is
multiplied by ``1 / microbatches_per_update`` (:func:`loss_scale`), so the sum of the
microbatch gradients (accumulated on a rank, then all-reduce-*summed* over
replicas) is the gradient of the mean loss over the whole minibatch. In
PipeDream's schedule a microbatch is a minibatch; replicas sum then divide by the
microbatches of the round (their number, except in a run's last, partial round).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dreampipe.errors import ScheduleError
from dreampipe.runtime.buckets import GradientBuckets
from dreampipe.runtime.comm import Comm
from dreampipe.runtime.loss_scaling import LossScale
from dreampipe.runtime.nonfinite import NonFiniteGuard
from dreampipe.runtime.stage_module import StageModule
from dreampipe.runtime.stage_ties import RankTie, left_out_of_norm, sum_ties
from dreampipe.runtime.zero_buckets import ShardBuckets
from dreampipe.scheduling.actions import Action, Schedule, ScheduleKind
from dreampipe.scheduling.updates import launched_rounds

__all__ = ["RankUpdates", "loss_scale"]


def loss_scale(schedule: Schedule) -> float:
    """What each microbatch's loss is multiplied by before its backward (module docstring)."""
    if schedule.kind is ScheduleKind.PIPEDREAM:
        return 1.0
    return 1.0 / schedule.microbatches_per_update


class RankUpdates:
    """The ``ALLREDUCE`` and ``STEP`` actions of rank ``rank``, whose stages are ``modules``.

    ``guard`` agrees on skipping an update; ``clip_group`` is the world group
    the gradient-norm all-reduce (with ``max_grad_norm``) and that agreement
    use, None for the default group; ``after_step`` runs after every weight
    update, with the module that stepped (its learning-rate scheduler's step).
    ``scaler``: fp16-mixed's loss scale, which every update unscales the gradients by
    (before clipping) and lowers when a stage's overflowed (:mod:`.loss_scaling`).
    ``ties``: the rank's copies of weights tied across stages, summed before clipping.
    """

    def __init__(
        self,
        rank: int,
        device: torch.device,
        guard: NonFiniteGuard,
        modules: Sequence[StageModule],
        *,
        max_grad_norm: float | None,
        clip_group: Any,
        after_step: Callable[[StageModule], None] | None,
        scaler: LossScale | None = None,
        ties: Sequence[RankTie] = (),
    ) -> None:
        self._rank = rank
        self._device = device
        self._guard = guard
        self._modules = list(modules)
        self._max_grad_norm = max_grad_norm
        self._clip_group = clip_group
        self._after_step = after_step
        self._scaler = scaler
        self._ties = list(ties)
        self._left_out = left_out_of_norm(ties)
        self._agreed: tuple[int, int, bool] | None = None
        self._launched: frozenset[tuple[int, int]] = frozenset()
        #: per stage, what its deferred ``STEP`` waits for before it steps
        self._landing: dict[int, Callable[[], None]] = {}

    def expect(self, actions: Sequence[Action], steps_agree: bool) -> None:
        """The rank runs ``actions``: note the all-reduces its steps leave in flight, which
        a run whose ranks agree at each update must not have (``steps_agree``)."""
        self._launched = launched_rounds(actions)
        if self._launched and (steps_agree or self._ties):
            raise ScheduleError(
                f"rank {self._rank}'s schedule defers a STEP past its ALLREDUCE, but its "
                "ranks agree at each update (clipping, a loss scale, skipping, or summing "
                "weights tied across stages): build it with steps_agree=True")

    def allreduce(
        self, a: Action, schedule: Schedule, module: StageModule,
        buckets: GradientBuckets | ShardBuckets, comm: Comm,
    ) -> None:
        """``ALLREDUCE`` ``a`` of ``module``'s stage: its buckets finished, the sum scaled;
        beside them the replicas sum which parameters their microbatches used, so that one
        none used gets no gradient, as in one process (the optimizer skips it). That sum
        follows the buckets: every replica has then issued the round's collectives, in
        the same order, whatever microbatches it ran. A deferred step's round is left in
        flight, the stage's later gradients going to its next update."""
        used = module.used_mask()
        scale = 1.0
        if schedule.kind is ScheduleKind.PIPEDREAM:
            r = schedule.replicas[a.stage]
            scale = 1.0 / min(r, schedule.num_microbatches - a.microbatch * r)
        deferred = (a.stage, a.microbatch) in self._launched
        if isinstance(buckets, ShardBuckets):  # the microbatches' reduce-scatters summed
            if deferred:
                raise ScheduleError(f"{a} of a stage at ZeRO 2 or 3 is left in flight past "
                                    "its STEP; its shards are the next update's: build the "
                                    "schedule with the stage's ZeRO level")
            buckets.finish(a, scale)
        else:
            buckets.launch(module.gradients())
        work = dist.all_reduce(used, group=buckets.group, async_op=True) if len(used) else None

        def land() -> None:
            if not isinstance(buckets, ShardBuckets):
                buckets.finish((), a, scale)
            if work is not None:
                comm.wait_allreduce(work, a)
            module.reduced([bool(u) for u in used.tolist()])

        if deferred:
            module.close_update()
            self._landing[a.stage] = land
        else:
            land()

    def step(
        self, a: Action, schedule: Schedule, first_microbatch: int, module: StageModule, comm: Comm
    ) -> None:
        """``STEP`` ``a`` of ``module``'s stage; ``first_microbatch`` numbers the schedule's
        microbatches
        in the run, so that the rank's stages agree once per update; a deferred step
        first waits for its all-reduce."""
        land = self._landing.pop(a.stage, None)
        if land is not None:
            land()
        now = (first_microbatch, a.microbatch)
        if self._agreed is None or self._agreed[:2] != now:
            overflowed = None
            if self._scaler is not None:
                overflowed = not self._scaler.unscale(
                    [g for m in self._modules for g in _held(m)[0]])
            self._agreed = (*now, self._guard.skips(a, self._clip_group, comm.wait_world,
                                                    overflowed))
            if self._scaler is not None:  # any update skipped: its gradients were not
                self._scaler.update(self._agreed[2])  # finite, as a GradScaler sees them
            if not self._agreed[2]:  # every rank agreed: all sum their ties, or none
                sum_ties(self._ties, lambda work: comm.wait_tied(work, a))
                if (self._max_grad_norm is not None
                        and not self._clip(a, schedule, comm, self._max_grad_norm)):
                    self._agreed = (*now, True)
        if self._agreed[2]:
            module.step(apply=False)
            if module.zero is not None:
                module.zero.drop()
            return
        module.step()
        if self._after_step is not None:
            self._after_step(module)

    def _clip(self, a: Action, schedule: Schedule, comm: Comm, max_norm: float) -> bool:
        """Scale this update's gradient by ``max_norm / global norm`` (at most 1), as
        ``torch.nn.utils.clip_grad_norm_`` does; the norm spans every stage, each
        stage counted once (its replicas hold the same all-reduced gradient, or under
        ZeRO-2 each its shard) and each tied weight once (its copies hold the same sum);
        under interleaving a rank clips all its stages at its first ``STEP`` of the
        update. False where the norm is not finite: the update is then skipped, or the run
        stops, as the run's ``on_nonfinite`` says (:meth:`~.nonfinite.NonFiniteGuard.
        norm_not_finite`), where ``clip_grad_norm_`` would make every gradient NaN."""
        held = [(m.stage, *_held(m)) for m in self._modules]
        grads = [g for _, gs, _ in held for g in gs]
        sq = torch.zeros((), dtype=torch.float64, device=self._device)
        first = schedule.replica_of_rank(self._rank) == 0
        for stage, gs, shard in held:
            for i, g in enumerate(gs if first or shard else ()):
                if (stage, i) not in self._left_out:
                    # a 16-bit gradient's norm in 32 bits: bf16 sums round off ~0.1%
                    wide = torch.float32 if g.dtype in _NARROW else None
                    sq += torch.linalg.vector_norm(g, 2, dtype=wide).double() ** 2
        work = dist.all_reduce(sq, group=self._clip_group, async_op=True)
        comm.wait_world(work, a)
        norm = math.sqrt(float(sq))
        if not math.isfinite(norm):
            self._guard.norm_not_finite(a, norm)
            return False
        coef = min(1.0, max_norm / (norm + 1e-6))
        for g in grads:
            g.mul_(coef)
        return True


_NARROW = (torch.bfloat16, torch.float16)


def _held(module: StageModule) -> tuple[list[torch.Tensor], bool]:
    """The update's gradients this rank holds of ``module``'s stage, and whether they are
    its shard (ZeRO-2, :mod:`.zero`) rather than the whole, all-reduced gradient."""
    zero = module.zero
    if zero is not None and zero.shards_gradients:
        return zero.gradients(), True
    return module.gradients(), False

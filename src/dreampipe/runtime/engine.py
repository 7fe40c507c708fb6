"""Run one rank's action list from the :class:`~dreampipe.scheduling.actions.Schedule`.

The engine never re-derives the order: :class:`RankRunner` executes
``schedule.actions[rank]`` in order, one small handler per action kind, and
posts the receives of the next few actions early (:mod:`.receives_ahead`). Only the last
backward before a rank's ``ALLREDUCE`` hands its gradients to
:class:`~dreampipe.runtime.buckets.GradientBuckets`. The input and last
stages read a microbatch's samples from
:class:`~dreampipe.runtime.stage_records.MicrobatchData`, so only activations and
gradients cross the pipeline. :meth:`RankRunner.advance` stops before the
first action whose microbatch has not been given yet; :meth:`RankRunner.switch`
takes a schedule that extends the prefix run so far. A rank that holds several
stages (interleaved 1F1B, the V schedules) keeps one lane (module, links, buckets) per
stage, and Zero Bubble's ``W`` runs :mod:`.split_backward`; an ``OVERLAP_F_B`` runs its
two halves through the overlap hook (:mod:`.overlap`); a ZeRO-3 stage's ``UNSHARD`` and
``RESHARD`` gather and free its weights (:mod:`.zero_params`). docs/design.md §8.4.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dreampipe.runtime.buckets import GradientBuckets, round_ends
from dreampipe.runtime.comm import Comm
from dreampipe.runtime.lanes import Links
from dreampipe.runtime.loss_scaling import LossScale
from dreampipe.runtime.nonfinite import NonFiniteGuard
from dreampipe.runtime.overlap import OverlapHook, OverlappedPair, one_after_the_other, run_pair
from dreampipe.runtime.receives_ahead import ReceivesAhead
from dreampipe.runtime.runner_options import RunnerOptions
from dreampipe.runtime.stage_module import StageModule
from dreampipe.runtime.stage_records import MicrobatchData, StageInput
from dreampipe.runtime.stage_ties import RankTie
from dreampipe.runtime.tensor_split import full_state
from dreampipe.runtime.two_bw import TwoVersions, check_two_versions
from dreampipe.runtime.update_actions import RankUpdates, loss_scale
from dreampipe.runtime.zero_buckets import ShardBuckets, stage_buckets
from dreampipe.runtime.zero_params import ZeroParams, check_gathers, sharded_weights
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.events import Event
from dreampipe.scheduling.unshard import pairs_per_use

__all__ = ["RankRunner"]

_log = logging.getLogger(__name__)


class RankRunner:
    """One rank's stage, data and links; :meth:`advance` executes its actions, a stretch at a time.

    ``clip_group`` and ``after_step`` are :class:`~dreampipe.runtime.update_actions.RankUpdates`'s
    (a learning-rate scheduler's step). ``others``: under interleaved 1F1B, the
    modules of the rank's other stages, in
    :meth:`~dreampipe.scheduling.actions.Schedule.stages_of_rank` order
    (docs/design.md §8.4). ``ties``: the rank's copies of weights tied across stages
    (:mod:`.stage_ties`), summed at each update. ``overlap`` runs each ``OVERLAP_F_B``'s
    halves (:mod:`.overlap`; default: one after the other).
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        device: torch.device,
        module: StageModule,
        opts: RunnerOptions,
        *,
        groups: dict[int, Any],
        links: tuple[Any, Any] | Links = (None, None),
        clip_group: Any = None,
        after_step: Callable[[StageModule], None] | None = None,
        others: Sequence[StageModule] = (),
        ties: Sequence[RankTie] = (),
        overlap: OverlapHook = one_after_the_other,
    ) -> None:
        self.opts = opts
        self.overlap = overlap
        self.schedule = schedule
        self.rank = rank
        self.device = device
        self.stage = schedule.stage_of_rank(rank)
        self.last = self.stage == schedule.num_stages - 1
        self.group = groups.get(self.stage)
        self.module = module
        self.data: MicrobatchData | None = None
        self.comm = Comm(
            schedule, rank, device, opts.timeout_s, vertical_sync=opts.vertical_sync, groups=links,
            varying=opts.varying_shapes,
        )
        self.scale = loss_scale(schedule)
        self.scaler = (LossScale(opts.loss_scale, opts.loss_scale_window)
                       if opts.precision.scales_loss else None)
        check_two_versions(schedule)
        self.two_bw = (TwoVersions(schedule.microbatches_per_update)
                       if schedule.kind is ScheduleKind.TWO_BW else None)
        self.buckets = stage_buckets(self.module.zero, self.module.params, self.group,
                                     self.comm.wait_allreduce, schedule, self.stage)
        if isinstance(self.module.zero, ZeroParams):
            self.module.zero.per_use = pairs_per_use(schedule, self.stage)
        self.guard = NonFiniteGuard(opts.on_nonfinite, schedule, rank, device)
        self._lanes = [_Lane(self.stage, module, self.comm, self.buckets)]
        for s, m in zip(schedule.stages_of_rank(rank)[1:], others, strict=True):
            comm = Comm(schedule, rank, device, opts.timeout_s, groups=links, stage=s,
                        mailbox=self.comm.mailbox, varying=opts.varying_shapes)
            self._lanes.append(_Lane(s, m, comm, stage_buckets(
                m.zero, m.params, groups.get(s), comm.wait_allreduce, schedule, s)))
        self._lane_of = {lane.stage: lane for lane in self._lanes}
        self._updates = RankUpdates(rank, device, self.guard, self.modules,
                                    max_grad_norm=opts.max_grad_norm, clip_group=clip_group,
                                    after_step=after_step, scaler=self.scaler, ties=ties)
        self._inputs: dict[int, tuple[Tensor, int | None]] = {}
        self._outputs: dict[int, tuple[Tensor, int | None]] = {}
        self._grads_in: dict[int, Tensor] = {}
        self._grads_out: dict[int, Tensor] = {}
        self.losses: dict[int, Tensor] = {}
        self.events: list[Event] = []
        self._handlers: dict[ActionKind, Callable[[Action], None]] = {
            ActionKind.RECV_F: self._recv_f,
            ActionKind.FORWARD: lambda a: self._forward_on(self._lane_of[a.stage], a),
            ActionKind.SEND_F: self._send_f,
            ActionKind.RECV_B: self._recv_b,
            ActionKind.BACKWARD: lambda a: self._backward_on(self._lane_of[a.stage], a),
            ActionKind.WEIGHT: self._weight,
            ActionKind.SEND_B: self._send_b,
            ActionKind.ALLREDUCE: self._allreduce,
            ActionKind.STEP: self._step,
            ActionKind.OVERLAP: self._overlapped,
            ActionKind.UNSHARD: lambda a: sharded_weights(self.module.zero, a).unshard(a),
            ActionKind.RESHARD: lambda a: sharded_weights(self.module.zero, a).reshard(),
        }
        self.t0 = time.perf_counter()
        self._pos = 0
        self._stop = 0
        self._index_schedule()

    @property
    def first_microbatch(self) -> int:
        """The run's number for this schedule's microbatch 0 (a Pipeline's later segments):
        events count microbatches and updates, and messages are tagged, over the whole run."""
        return self._lanes[0].comm.first_microbatch

    def feed(self, data: MicrobatchData) -> None:
        """Take the microbatches' samples from ``data`` from now on (the stages that read
        samples)."""
        self.data = data

    def start_segment(self, first_microbatch: int, first_minibatch: int) -> None:
        """Number this schedule's microbatches from ``first_microbatch`` and its minibatches from
        ``first_minibatch`` in the run (events, message tags, skipped updates)."""
        for lane in self._lanes:
            lane.comm.first_microbatch = first_microbatch
            lane.comm.set_aside_unclaimed()
        self.guard.first_minibatch = first_minibatch

    def _use(self, stage: int) -> None:
        """Run the next actions as ``stage`` (one of the rank's, under interleaving)."""
        lane = self._lane_of[stage]
        self.stage, self.module, self.comm, self.buckets = (
            lane.stage, lane.module, lane.comm, lane.buckets)
        self.last = stage == self.schedule.num_stages - 1

    def _post(self, a: Action) -> bool:
        return self._lane_of[a.stage].comm.post(a)

    def start_clock(self, t0: float) -> None:
        """Time events from ``t0`` (a ``time.perf_counter()`` taken on every rank after a
        barrier, so that all ranks' events share one origin)."""
        self.t0 = t0

    def _index_schedule(self) -> None:
        """Index the receives (:mod:`.receives_ahead`: posting resumes at the first one not
        yet run) and the rounds' last backwards."""
        actions = self.schedule.actions[self.rank]
        check_gathers(self._lanes[0].module.zero, actions, self._lanes[0].stage)
        self._receives = ReceivesAhead(self.schedule, self.rank, self._pos)
        self._round_ends = round_ends(actions)
        self._updates.expect(actions, self.opts.steps_agree)

    # ---- handlers ----------------------------------------------------------
    def _recv_f(self, a: Action) -> None:
        self._inputs[a.microbatch] = self.comm.take(a)

    def _forward_on(self, lane: _Lane, a: Action) -> None:
        """Forward ``a`` on ``lane``'s stage (what it reads and writes is ``a``'s alone, so
        an overlapped pair's halves may run at once)."""
        u, stage, module = a.microbatch, lane.stage, lane.module
        last = stage == self.schedule.num_stages - 1
        target = None
        version: int | None = None
        assert self.data is not None or stage > 0
        x: StageInput
        if stage == 0:
            assert self.data is not None
            x = self.data.inputs(u)
            if self.opts.vertical_sync:
                version = module.version
        else:
            x, version = self._inputs.pop(u)
            if version is not None:
                module.note_version(version)
        if self.two_bw is not None:
            version = self.two_bw.version(u, module.version)
            module.note_version(version)
        if last:
            assert self.data is not None
            target = self.data.targets(u)
        scale = self.scale if self.scaler is None or not last else \
            self.scale * self.scaler.value
        if self.last:
            assert self.data is not None
            scale *= self.data.share(u)
        with self.opts.precision.forwards(self.device.type):
            out = module.forward(u, x, version=version, target=target, scale=scale,
                                 update=u // self.schedule.round_microbatches(stage))
        self.guard.check(a, out, x, last)
        if last:
            self.losses[u] = out
        else:
            self._outputs[u] = (out, version)

    def _send_f(self, a: Action) -> None:
        out, version = self._outputs.pop(a.microbatch)
        self.comm.send(a, out, version)

    def _recv_b(self, a: Action) -> None:
        self._grads_in[a.microbatch] = self.comm.take(a)[0]
        self.comm.forget(a.microbatch)

    def _backward_on(self, lane: _Lane, a: Action) -> None:
        """Backward ``a`` on ``lane``'s stage (as :meth:`_forward_on`, ``a``'s alone)."""
        module = lane.module
        last = lane.stage == self.schedule.num_stages - 1
        grad = None if last else self._grads_in.pop(a.microbatch)
        with module.backward_scope():  # ZeRO-3: what it gathers goes at its end
            if self.schedule.kind.splits_backward:
                gin = module.backward_input(a.microbatch, grad)
            else:
                gin = self._fused_backward(lane, a, grad)
        if lane.stage > 0:
            assert gin is not None
            self._grads_out[a.microbatch] = gin

    def _fused_backward(self, lane: _Lane, a: Action, grad: Tensor | None) -> Tensor | None:
        """Both gradients in one backward; the Linear weight GEMMs held until ``SEND_B``."""
        if isinstance(lane.buckets, ShardBuckets):  # ZeRO-2: every microbatch's, as it ends
            gin = lane.module.backward(a.microbatch, grad, on_ready=lane.buckets.ready)
            lane.buckets.settle(a)
            return gin
        on_ready = lane.buckets.ready if a.microbatch in self._round_ends else None
        return lane.module.backward(a.microbatch, grad, on_ready=on_ready, hold=lane.stage > 0)

    def _overlapped(self, a: Action) -> None:
        """DualPipeV's ``F&B``: the forward and the backward through :attr:`overlap`, each
        recorded as its own event when events are kept."""
        forward, backward = a.parts
        f_lane, b_lane = self._lane_of[forward.stage], self._lane_of[backward.stage]
        run_pair(self.overlap, OverlappedPair(
            forward.stage, forward.microbatch, f_lane.module.module,
            backward.stage, backward.microbatch, b_lane.module.module,
            lambda: self._timed(forward, lambda: self._forward_on(f_lane, forward)),
            lambda: self._timed(backward, lambda: self._backward_on(b_lane, backward))))

    def _timed(self, a: Action, run: Callable[[], None]) -> None:
        """``run()``, recorded as ``a``'s event (its numbers the run's) when events are kept."""
        if not self.opts.record_events:
            run()
            return
        start = time.perf_counter()
        run()
        first = self.first_microbatch
        shift = first, first // self.schedule.round_microbatches(self._lanes[0].stage)
        self.events.append(Event.of(self.rank, a.shifted(*shift), start - self.t0,
                                    time.perf_counter() - self.t0))

    def _weight(self, a: Action) -> None:
        """Zero Bubble's ``W``: the weight gradients its ``B`` left (its all-reduce, on a
        replicated stage, takes them all at ``ALLREDUCE``)."""
        with self.module.backward_scope():
            self.module.backward_weight(a.microbatch)
        if isinstance(self.buckets, ShardBuckets):
            self.buckets.scatter(self.module.pop_gradients(), a)

    def _send_b(self, a: Action) -> None:
        self.comm.send(a, self._grads_out.pop(a.microbatch))
        self.module.run_held()

    def _allreduce(self, a: Action) -> None:
        self._updates.allreduce(a, self.schedule, self.module, self.buckets, self.comm)

    def _step(self, a: Action) -> None:
        if self.two_bw is not None:  # the next minibatch runs on the live weights: older go
            self.module.note_version(self.module.version)
        self._updates.step(a, self.schedule, self.first_microbatch, self.module, self.comm)

    # ---- loop ----------------------------------------------------------------
    def advance(self, given: int | None = None, post_until: int | None = None) -> None:
        """Execute the next actions, up to the first that needs a microbatch ``>= given``.

        ``given`` None runs to the end of the schedule. Receives are posted
        up to :data:`~dreampipe.runtime.receives_ahead.LOOKAHEAD` actions ahead, never
        past that stop, or, where the backend allows it, past the stop that
        ``post_until`` would give.
        """
        actions, receives = self.schedule.actions[self.rank], self._receives
        stop, post_stop = receives.stops(self._pos, given,
                                         post_until if self.comm.posts_ahead else None)
        self._stop = stop
        handlers = self._handlers
        post = self.comm.post if len(self._lanes) == 1 else self._post
        record = self.opts.record_events
        for i in range(self._pos, stop):
            receives.post(i, post_stop, post)
            a = actions[i]
            if a.stage != self.stage:
                self._use(a.stage)
            if record:
                self._timed(a, functools.partial(handlers[a.kind], a))
            else:
                handlers[a.kind](a)
            self._pos = i + 1
        self._use(self._lanes[0].stage)

    @property
    def done(self) -> bool:
        """Whether every action of the schedule has run."""
        return self._pos == len(self.schedule.actions[self.rank])

    def switch(self, schedule: Schedule) -> None:
        """Continue with ``schedule``, which must begin with the runnable prefix so far."""
        old, new = self.schedule.actions[self.rank], schedule.actions[self.rank]
        assert new[: self._stop] == old[: self._stop], (
            f"rank {self.rank}: the new schedule does not extend the prefix it ran"
        )
        self.schedule = self.guard.schedule = schedule
        for lane in self._lanes:
            lane.comm.schedule = schedule
        self._index_schedule()

    def restart(self, schedule: Schedule) -> None:
        """Start ``schedule`` from its first action (a new segment: the pipeline fills again)."""
        assert self.done and not (self._inputs or self._outputs or self._grads_in), (
            f"rank {self.rank} restarts with work in flight"
        )
        self.drain()
        self.schedule = self.guard.schedule = schedule
        for lane in self._lanes:
            lane.comm.schedule = schedule
        self._pos = self._stop = 0
        self.losses = {}
        if self.two_bw is not None:
            self.two_bw.restart()
        for m in self.modules:
            m.versions.restart()
        self._index_schedule()

    def final_state(self) -> dict[str, Tensor]:
        """This rank's trained ``state_dict`` (all its stages'), copied to the CPU for rank 0
        (a split stage's weights gathered whole: every worker of the stage calls this)."""
        return {k: v for state in self.final_states().values() for k, v in state.items()}

    def final_states(self) -> dict[int, dict[str, Tensor]]:
        """:meth:`final_state` by stage (with :attr:`gathers_state`, every replica calls it)."""
        return {lane.stage: {k: v.detach().cpu().clone()
                             for k, v in full_state(lane.module.state_dict()).items()}
                for lane in self._lanes}

    @property
    def gathers_state(self) -> bool:
        """Whether :meth:`final_states` is a collective over a stage's replicas, which then
        all call it: ZeRO's sharded 32-bit master weights or level 3's weights (:mod:`.zero`)."""
        return any(m.zero is not None and m.zero.gathers_state for m in self.modules)

    def drain(self) -> None:
        """Wait for every send this rank posted (each of its stages')."""
        for lane in self._lanes:
            lane.comm.drain()

    @property
    def modules(self) -> list[StageModule]:
        """The rank's stage modules: one, or its interleaved stages in order."""
        return [lane.module for lane in self._lanes]


@dataclass
class _Lane:
    """One stage a rank runs: its module, links and gradient buckets."""

    stage: int
    module: StageModule
    comm: Comm
    buckets: GradientBuckets | ShardBuckets

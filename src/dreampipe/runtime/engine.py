"""Run one rank's action list from the :class:`~dreampipe.scheduling.actions.Schedule`.

The engine never re-derives the order: it executes ``schedule.actions[rank]``
in order, one small handler per action kind, and only looks ahead to post
the receives of the next few actions early so communication overlaps
compute::

    actions   RECV_F4  F4  SEND_F4  RECV_B2  B2  SEND_B2  STEP2  RECV_F5 ...
    posted    ^^^^^^^ ...  (irecv for RECV_* within _LOOKAHEAD actions ahead)

Gradient all-reduce (replicated stages): the engine marks, once, each
``BACKWARD`` that is the last before the rank's next ``ALLREDUCE``; only that
backward hands its gradients to :class:`~dreampipe.runtime.buckets.GradientBuckets`
as they become final, so the buckets' all-reduces run during it. Earlier
backwards of the round only accumulate; ``ALLREDUCE<k>`` waits for the
buckets and applies the scale::

    actions   F6  B6  F7  B7* SEND_B7  ALLREDUCE3  STEP3      (* marked)
    buckets               [b0 b1 b2 ...]  wait, scale

Labels: the input stage and the last stage both index the same
:class:`~dreampipe.runtime.data.Dataset` with ``batch(unit, unit_size)``, so the last
stage loads a unit's targets itself and nothing but activations and
gradients crosses the pipeline.

Loss scaling: in the synchronous schedules each microbatch's mean loss is
multiplied by ``1 / units_per_update``, so the sum of the microbatch
gradients (accumulated on a rank, then all-reduce-*summed* over replicas) is
the gradient of the mean loss over the whole minibatch. In PipeDream's
schedule a unit is a minibatch; replicas sum then divide by their number.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dreampipe.models.spec import ModelSpec
from dreampipe.runtime.buckets import GradientBuckets
from dreampipe.runtime.comm import Comm
from dreampipe.runtime.config import OptimizerKind, RunConfig
from dreampipe.runtime.data import Dataset, load_dataset
from dreampipe.runtime.stage import StageModule
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.events import Event

__all__ = ["RankReport", "RankRunner", "barrier", "round_ends"]

_log = logging.getLogger(__name__)

_LOOKAHEAD = 8
_RECVS = (ActionKind.RECV_F, ActionKind.RECV_B)


@dataclass
class RankReport:
    """What one rank measured; gathered on rank 0 to build the RunResult."""

    rank: int
    stage: int
    replica: int
    loop_s: float
    losses: dict[int, float] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    state: dict[str, Tensor] | None = None
    peak_versions: int = 0


def round_ends(actions: tuple[Action, ...]) -> frozenset[int]:
    """Units whose ``BACKWARD`` is the last before the rank's next ``ALLREDUCE``."""
    ends: set[int] = set()
    last: int | None = None
    for a in actions:
        if a.kind is ActionKind.BACKWARD:
            last = a.unit
        elif a.kind is ActionKind.ALLREDUCE and last is not None:
            ends.add(last)
            last = None
    return frozenset(ends)


def _make_optimizer(
    cfg: RunConfig,
) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    """The optimizer factory a stage calls with its own parameters (each rank builds its own)."""
    def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if cfg.optimizer is OptimizerKind.ADAM:
            return torch.optim.Adam(params, lr=cfg.lr)
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)

    return build


class RankRunner:
    """One rank's stage, data and links; :meth:`run` executes its actions."""

    def __init__(
        self,
        cfg: RunConfig,
        spec: ModelSpec,
        schedule: Schedule,
        rank: int,
        device: torch.device,
        groups: dict[int, Any],
        links: tuple[Any, Any] = (None, None),
    ) -> None:
        self.cfg = cfg
        self.schedule = schedule
        self.rank = rank
        self.device = device
        self.stage = schedule.stage_of_rank(rank)
        self.last = self.stage == schedule.num_stages - 1
        self.group = groups.get(self.stage)
        st = cfg.plan.stages[self.stage]
        module = spec.build(st.first, st.last, cfg.seed).to(device).train()
        self.module = StageModule(
            module,
            _make_optimizer(cfg),
            stage=self.stage,
            input_grad=self.stage > 0,
            stash=cfg.stash,
            vertical_sync=cfg.vertical_sync,
            loss_fn=spec.loss_fn,
        )
        self.comm = Comm(
            schedule, rank, device, cfg.timeout_s, vertical_sync=cfg.vertical_sync, groups=links
        )
        self.data: Dataset | None = None
        if self.stage == 0 or self.last:
            self.data = load_dataset(cfg.dataset, spec, data_dir=cfg.data_dir, seed=cfg.seed)
        self.pipedream = schedule.kind is ScheduleKind.PIPEDREAM
        self.scale = 1.0 if self.pipedream else 1.0 / schedule.units_per_update
        self.allreduce_scale = 1.0 / schedule.replicas[self.stage] if self.pipedream else 1.0
        self.buckets = GradientBuckets(self.module.params, self.group, self.comm.wait_allreduce)
        self._round_ends = round_ends(schedule.actions[rank])
        self._inputs: dict[int, tuple[Tensor, int | None]] = {}
        self._outputs: dict[int, tuple[Tensor, int | None]] = {}
        self._grads_in: dict[int, Tensor] = {}
        self._grads_out: dict[int, Tensor] = {}
        self._losses: dict[int, Tensor] = {}
        self._handlers: dict[ActionKind, Callable[[Action], None]] = {
            ActionKind.RECV_F: self._recv_f,
            ActionKind.FORWARD: self._forward,
            ActionKind.SEND_F: self._send_f,
            ActionKind.RECV_B: self._recv_b,
            ActionKind.BACKWARD: self._backward,
            ActionKind.SEND_B: self._send_b,
            ActionKind.ALLREDUCE: self._allreduce,
            ActionKind.STEP: self._step,
        }
        self._bar: Any = None
        self._bar_start = 0.0

    # ---- handlers ----------------------------------------------------------
    def _batch(self, unit: int) -> tuple[Tensor, Tensor]:
        assert self.data is not None
        x, y = self.data.batch(unit, self.cfg.layout.unit_size)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _recv_f(self, a: Action) -> None:
        self._inputs[a.unit] = self.comm.take(a)

    def _forward(self, a: Action) -> None:
        u = a.unit
        target = None
        version: int | None = None
        if self.stage == 0:
            x, y = self._batch(u)
            if self.last:
                target = y
            if self.cfg.vertical_sync:
                version = self.module.version
        else:
            x, version = self._inputs.pop(u)
            if version is not None:
                self.module.note_version(version)
            if self.last:
                assert self.data is not None
                target = self.data.targets(u, self.cfg.layout.unit_size).to(
                    self.device, non_blocking=True
                )
        out = self.module.forward(u, x, version=version, target=target, scale=self.scale)
        if self.last:
            self._losses[u] = out
        else:
            self._outputs[u] = (out, version)

    def _send_f(self, a: Action) -> None:
        out, version = self._outputs.pop(a.unit)
        self.comm.send(a, out, version)

    def _recv_b(self, a: Action) -> None:
        self._grads_in[a.unit] = self.comm.take(a)[0]
        self.comm.forget(a.unit)

    def _backward(self, a: Action) -> None:
        grad = None if self.last else self._grads_in.pop(a.unit)
        on_ready = self.buckets.ready if a.unit in self._round_ends else None
        gin = self.module.backward(a.unit, grad, on_ready=on_ready)
        if self.stage > 0:
            assert gin is not None
            self._grads_out[a.unit] = gin
        if self._bar is not None:
            self._bar.update(1)
            elapsed = time.perf_counter() - self._bar_start
            rate = self._bar.n * self.cfg.layout.unit_size / elapsed if elapsed > 0 else 0.0
            self._bar.set_postfix(
                loss=f"{float(self._losses[a.unit]):.4f}", samples_per_s=f"{rate:.0f}",
                refresh=False,
            )

    def _send_b(self, a: Action) -> None:
        self.comm.send(a, self._grads_out.pop(a.unit))

    def _allreduce(self, a: Action) -> None:
        self.buckets.finish(self.module.gradients(), a, self.allreduce_scale)

    def _step(self, a: Action) -> None:
        self.module.step()

    # ---- loop ----------------------------------------------------------------
    def run(self, t0: float) -> RankReport:
        """Execute every action; times in the report are relative to ``t0``."""
        actions = self.schedule.actions[self.rank]
        recv_at = [i for i, a in enumerate(actions) if a.kind in _RECVS]
        nxt = 0
        handlers = self._handlers
        post = self.comm.post
        events: list[Event] = []
        record = self.cfg.record_events
        clock = time.perf_counter
        self._open_progress(actions)
        try:
            for i, a in enumerate(actions):
                while nxt < len(recv_at) and recv_at[nxt] <= i + _LOOKAHEAD:
                    if not post(actions[recv_at[nxt]]):
                        break
                    nxt += 1
                if record:
                    start = clock()
                    handlers[a.kind](a)
                    events.append(Event.of(self.rank, a, start - t0, clock() - t0))
                else:
                    handlers[a.kind](a)
            self.comm.drain()
        finally:
            if self._bar is not None:
                self._bar.close()
        loop_s = clock() - t0
        return RankReport(
            rank=self.rank,
            stage=self.stage,
            replica=self.schedule.replica_of_rank(self.rank),
            loop_s=loop_s,
            losses={u: float(v) for u, v in self._losses.items()},
            events=events,
            peak_versions=self.module.peak_versions,
        )

    def _open_progress(self, actions: tuple[Action, ...]) -> None:
        if not (self.cfg.progress and self.last and self.schedule.replica_of_rank(self.rank) == 0):
            return
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())
        total = sum(1 for a in actions if a.kind is ActionKind.BACKWARD)
        unit = "minibatch" if self.pipedream else "microbatch"
        self._bar = tqdm(total=total, unit=unit, file=sys.stderr, dynamic_ncols=True)
        self._bar_start = time.perf_counter()

    def final_state(self) -> dict[str, Tensor]:
        """This stage's trained ``state_dict``, copied to the CPU for rank 0."""
        return {k: v.detach().cpu().clone() for k, v in self.module.module.state_dict().items()}


def barrier(timeout_s: float) -> None:
    """A barrier with a deadline where the backend has one (gloo)."""
    from datetime import timedelta

    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        dist.barrier()

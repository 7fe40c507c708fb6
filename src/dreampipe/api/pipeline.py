"""``dreampipe.Pipeline``: train your own model, data, optimizer and loop with a plan.

Every rank runs the same script (under ``torchrun`` or alone)::

    pipe = Pipeline(model, example=(x, y), loss_fn=F.cross_entropy,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4))
    for x, y in loader:          # the same stream on every rank
        pipe.step(x, y)
    losses = pipe.finish()       # per-minibatch losses, the same on every rank

Each rank builds its stage's layers (:mod:`.split`) and runs its actions of one
:class:`~dreampipe.scheduling.actions.Schedule` (:class:`~dreampipe.runtime.engine.RankRunner`)
step by step; ``finish()`` drains, and a segment holds at most :data:`SEGMENT_MICROBATCHES`
microbatches (:mod:`.pipeline_segments`). How steps, drains and segments train:
docs/design.md §8.5.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dreampipe.api import checkpoint
from dreampipe.api.batch_shapes import BatchShapes, check_held_out
from dreampipe.api.checks import (
    Batch,
    Inputs,
    check_arguments,
    check_schedulers,
    map_inputs,
    mode_warning,
    packing_warning,
    refuse_legacy,
)
from dreampipe.api.config import TrainConfig
from dreampipe.api.evaluation import (
    EvalRank,
    EvalResult,
    check_evaluable,
    evaluate,
    first_replicas_buffers,
)
from dreampipe.api.glue_modes import GlueModes
from dreampipe.api.group import init_process_group, rank_device
from dreampipe.api.hf_checkpointing import check_hf_checkpointing
from dreampipe.api.memory_report import MemoryReport, counted, counting, measured, start
from dreampipe.api.pipeline_segments import HORIZON, Segments
from dreampipe.api.plans import PlanArg, profile_layers
from dreampipe.api.rank_groups import end_groups, rank_groups
from dreampipe.api.settled_plan import settle_plan
from dreampipe.api.stage_build import (
    agreement_note,
    build_modules,
    compensate_modules,
    compensation_delays,
    follow_schedulers,
)
from dreampipe.api.ties import check_tie_groups, tie_places
from dreampipe.errors import ConfigError, WorkerError
from dreampipe.runtime.engine import RankRunner
from dreampipe.runtime.overlap import model_hook
from dreampipe.runtime.stage_module import StageModule
from dreampipe.runtime.staleness import Applied
from dreampipe.runtime.zero_params import gathered
from dreampipe.scheduling.events import Event
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout
from dreampipe.splitter.chain import held_keys, split_layers
from dreampipe.splitter.segments import eval_refusal
from dreampipe.splitter.state_keys import state_keys

__all__ = ["SEGMENT_MICROBATCHES", "Pipeline"]

_log = logging.getLogger(__name__)
#: The most microbatches a segment holds before :meth:`Pipeline.step` drains it.
SEGMENT_MICROBATCHES = 8192
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class Pipeline:
    """A model trained by a plan's stages, one rank each; see the module docstring.

    ``model``: an ``nn.Sequential``, or a module whose forward ``torch.fx``
    traces around its blocks (:mod:`.trace`), possibly on the meta device
    (each stage then runs the model's own initialisation, :mod:`.materialise`);
    a weight tied across stages stays tied (:mod:`.ties`). ``example``: one
    minibatch ``(input, target)``, the input a tensor, a tuple, or a dict of the
    model's keyword arguments (``model(**x)``); every step's minibatch must match
    its shapes but in ``config.variable_dims`` (:mod:`.batch_shapes`).
    ``loss_fn(output, target)`` gets the output as the model returns it and returns
    the mean over the microbatch's samples, or over its targets but those equal to
    ``config.ignore_index`` (a token mean): each microbatch's loss counts its share, so
    the update is one process's over the whole minibatch.
    ``optimizer(params)`` and ``lr_scheduler(optimizer)`` build each stage's
    own; the scheduler steps after every weight update of its stage.
    ``plan``: ``"auto"`` (rank 0 profiles and plans for the world, :mod:`.plans`),
    a :class:`~dreampipe.planning.plan.Plan`, a plan file's path, or a list of
    split points, the names of the modules that begin a new stage
    (``plan=["transformer.h.6"]``: one stage per worker, or ``world * v`` with
    ``virtual_stages=v``; a Plan of ``world * v / r`` stages each on ``r`` replicas runs
    ``r`` copies of the pipeline, one whose positions have their own counts (``2-1-2-1``)
    replicates those positions, docs/design.md §7.7). ``config``: how it trains
    (:class:`~dreampipe.api.config.TrainConfig`: the schedule, microbatches,
    clipping, precision, staleness compensation...); :attr:`config` is the one
    that runs, with the schedule ``"auto"`` chose (:attr:`kind`, the reasons
    logged) and the plan's ``virtual_stages``. A model with an ``overlap_pair(pair)``
    method runs each of dualpipev's overlapped forward and backward pairs through it,
    where it overlaps its own communication (:mod:`dreampipe.runtime.overlap`; without
    one, the forward, then the backward). The layers are trained in place.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        example: Batch,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        optimizer: OptimizerFactory,
        plan: PlanArg = "auto",
        config: TrainConfig = TrainConfig(),
        lr_scheduler: SchedulerFactory | None = None,
        **legacy: object,
    ) -> None:
        refuse_legacy(legacy)
        if not isinstance(config, TrainConfig):
            raise ConfigError(f"config={config!r}; give a TrainConfig, e.g. "
                              "config=TrainConfig(schedule='1f1b-flush')", "config")
        check_arguments(config, plan, example, optimizer)
        check_hf_checkpointing(model)
        self._owns_group = init_process_group(config.timeout_s)
        self.device = rank_device()  # current before plan="auto" measures on it
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.kind = config.kind  # under "auto", a stand-in until settle_plan chooses
        self.layout = MicrobatchLayout(kind=self.kind, minibatch_size=int(example[1].shape[0]),
                                       microbatches=config.per_minibatch, workers=world)
        microbatch_size = self.layout.microbatch_size
        self._layers = split_layers(model, map_inputs(example[0], lambda t: t[:microbatch_size]))
        self._glue = GlueModes.of(model, self._layers)
        refused = eval_refusal(self._layers)
        if refused is not None and self.rank == 0:
            _log.warning("%s: training runs it, but evaluate() will refuse", refused)
        for said in (mode_warning(model), packing_warning(model, example[0])):
            if said is not None and self.rank == 0:
                _log.warning("%s", said)
        #: Every key of the model's state dict, for full_state_dict and checkpoints.
        self.state_keys = state_keys(model, held_keys(self._layers))
        # "auto" weighing the study's epochs chose the schedule: its advice is already taken
        weighed = config.schedule == "auto" and config.semantics == "any"
        settled = settle_plan(model, self._layers, plan, example=example, loss_fn=loss_fn,
                              config=config, layout=self.layout, world=world)
        self.plan, self.layout, self.kind = settled.plan, settled.layout, settled.layout.kind
        self._shapes = BatchShapes(example, config.variable_dims,  # the microbatches chosen
                                   self.layout.microbatches_per_update)
        self._virtual = self.plan.virtual_stages
        #: The config this Pipeline runs: the schedule ``"auto"`` chose, the plan's
        #: stages per worker.
        self.config = config = settled.config
        ties = settled.ties
        #: Each weight tied across stages, by its names on them (a checkpoint may hold it
        #: under any one of them).
        self.tie_names = tuple(tie.names for tie in ties)
        self.replicas = [st.replicas for st in self.plan.stages]
        #: The segments' schedules (a schedule file's, or the kind's), feeds and losses.
        self._segments = Segments(self.plan, self.layout, config, SEGMENT_MICROBATCHES,
                                  tied=bool(ties))
        found = checkpoint.find(Path(config.resume)) if config.resume is not None else None
        if found is not None:
            checkpoint.check_keys(found, self._layers)
        talk = rank_groups(self.plan, self.rank, self.device.type,
                           clip=config.max_grad_norm is not None)
        #: The rank in the schedule (one per replica) and, in a split stage, the
        #: worker's place among its replica's t workers (only place 0 reports).
        self.srank, self.member = talk.routes.rank, talk.routes.member
        self._groups: list[Any] = list(talk.made)  # every subgroup made here, for close()
        self._links = talk.links
        self._meter = start(self.config, [
            layer for s in self._my_stages() for _, layer in
            self._layers[self.plan.stages[s].first : self.plan.stages[s].last + 1]],
            self.device)
        tied = tie_places(ties, self.plan, talk.routes)
        self._groups += tied.made
        with counting(self._meter):  # the stage's build counts in its peak
            modules = build_modules(
                self._layers, self.plan, self._my_stages(), self.device, talk.mesh,
                optimizer=optimizer, loss_fn=loss_fn, config=self.config, rank=self.srank,
                start=tied.start, firsts=talk.routes.firsts)
            check_tie_groups(ties, modules)
            delayed = None if self.kind.synchronous else self._segments.build(HORIZON)
            applied = compensate_modules(  # before the schedulers: they keep the rates they see
                modules, delayed, config.vertical_sync, enabled=config.compensate,
                advise=self.rank == 0, uniform=bool(ties), weighed=weighed)
            #: The delay each of this rank's stages is compensated for, None for none.
            self.compensation_delays = compensation_delays(
                delayed, [m.stage for m in modules], config.vertical_sync,
                enabled=config.compensate, uniform=bool(ties))
            self._follow = follow_schedulers(applied, self.compensation_delays)
            note = agreement_note(delayed, self.config.runner_options())
            if self.rank == 0 and note is not None:
                _log.info("%s", note)
            self.module = modules[0]
            #: What staleness compensation did to each parameter group of each stage's
            #: optimizer, by stage: ``(given, used)`` settings, None where nothing
            #: (checkpoints carry it).
            self.compensations: dict[int, Applied] = applied
            self.schedulers = {m.stage: lr_scheduler(m.optimizer) for m in modules
                               if lr_scheduler is not None and m.optimizer is not None}
            check_schedulers(self.schedulers)
            for m in modules:
                self._follow(m)
            self.scheduler = self.schedulers.get(self.module.stage)
            self.loss_fn = loss_fn
            self.minibatches = 0
            self._opts = self.config.runner_options()
            self._runner: RankRunner | None = RankRunner(
                self._segments.schedule(self._segments.horizon), self.srank, self.device,
                self.module, self._opts, groups=talk.stage_groups, links=self._links,
                clip_group=talk.clip_group, after_step=self._after_step, others=modules[1:],
                ties=tied.ranks(modules), overlap=model_hook(model),
            )
            self._segment = 0
            self._pending: list[float] = []
            self._stopped: str | None = None  # the error a step or drain stopped at
            self._feed = self._segments.feed(self.runner)
            if found is not None:
                self.minibatches = checkpoint.load(found, self)

    @property
    def runner(self) -> RankRunner:
        """What runs this rank's schedule; gone once :meth:`close` ended the run."""
        if self._runner is None:
            raise ConfigError("this Pipeline is closed: close() ended its process groups; "
                              "build a new Pipeline to train again")
        return self._runner

    # ---- training ----------------------------------------------------------
    def memory(self) -> MemoryReport:
        """This rank's peak memory beside its stage's prediction, with
        ``measure_memory=True`` (drains first; a collective: every rank calls it)."""
        self._drain()
        largest, size = self._shapes.largest()  # the example, or longer samples met since
        return measured(self._meter, self.rank, self.runner.modules,
                        self.config, self.plan, self._layers, self._segments.build,
                        lambda: profile_layers(self._layers, largest, self.loss_fn, size,
                                               self.config, timed=False),
                        self.minibatches, lambda: gathered(m.zero for m in self.runner.modules),
                        schedule_rank=self.srank)

    def _my_stages(self) -> tuple[int, ...]:
        """The stages this rank runs: its plan stage, or those the placement gives it."""
        return self.plan.stages_of_rank(self.rank)

    def _after_step(self, module: StageModule) -> None:
        scheduler = self.schedulers.get(module.stage)
        if scheduler is not None:
            scheduler.step()
            self._follow(module)

    @counted
    def step(self, x: Inputs, y: Tensor) -> None:
        """Train on one more minibatch (the same on every rank); see the module docstring."""
        self._shapes.check(self.minibatches, (x, y))
        self._glue.check()
        with self._running():
            if self._segment == 0 and self.runner.done:
                self._feed = self._segments.restart(
                    self.runner, self._segments.horizon_from(self.minibatches))
            if self._segment == 0:
                self.runner.start_segment(self.minibatches * self.layout.microbatches_per_update,
                                          self.minibatches)
            self._feed.add(self._segment, (x, y))
            self._segment += 1
            self.minibatches += 1
            if (longer := self._segments.grown(self._segment)) is not None:
                self.runner.switch(longer)
            per = self.layout.microbatches_per_update
            self.runner.advance(self._segment * per, post_until=(self._segment + 1) * per)
            if self._segment == self._segments.cap:
                _log.debug("segment of %d minibatches full at minibatch %d: draining",
                           self._segments.cap, self.minibatches)
                self._drain()

    @counted
    def reserve(self, minibatches: int) -> None:
        """Build the schedule for the next ``minibatches`` steps now, so that no
        :meth:`step` among them pauses every rank to extend it (it grows 4-fold when it
        runs short, up to a full segment; steps past one start the next segments on
        schedules built here too). ``dreampipe train`` reserves before it times."""
        if minibatches < 1:
            raise ConfigError(f"reserve({minibatches}): reserve at least 1 minibatch",
                              "minibatches")
        start = self.minibatches - self._segment
        horizon = self._segments.reserve(start, self.minibatches + minibatches)
        if self._segment == 0 and self.runner.done:
            self._feed = self._segments.restart(self.runner, horizon)
        elif horizon > self._segments.horizon:
            self.runner.switch(self._segments.move_to(horizon))
        self._segments.build_later(start)

    @counted
    def _drain(self) -> None:
        """Run the segment's exact schedule to its end and collect its losses."""
        with self._running():
            runner, n = self.runner, self._segment
            if n == 0:
                return
            runner.switch(self._segments.schedule(n))
            runner.advance()
            runner.drain()
            self._pending += self._segments.losses(runner, self._feed, n, reports=self.member == 0)
            self._segment = 0

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """Drive the runner: an error leaves it within a schedule, so the Pipeline stops
        there, and says so at its next use (``close()`` still ends it)."""
        if self._stopped is not None:
            raise WorkerError(f"this Pipeline stopped at an error ({self._stopped}) and "
                              "cannot train on from there; make a new Pipeline, or resume "
                              "from a checkpoint (TrainConfig(resume=...))")
        try:
            yield
        except BaseException as exc:
            self._stopped = f"{type(exc).__name__}: {exc}"
            raise

    def finish(self) -> list[float]:
        """Drain the pipeline; the losses of the minibatches since the last finish, in order."""
        self._drain()
        out, self._pending = self._pending, []
        return out

    # ---- evaluation and state ------------------------------------------------
    @counted
    def evaluate(self, loader: Iterable[Batch]) -> EvalResult:
        """Forwards of every batch with the current weights (drains first); same on every rank."""
        check_evaluable(self._layers)
        batches = [(x, y) for x, y in loader]
        for k, batch in enumerate(batches):
            check_held_out(k, batch, self._shapes.example)
        self._drain()
        me = EvalRank(replicas=self.replicas, srank=self.srank, reports=self.member == 0,
                      device=self.device, timeout_s=self._opts.timeout_s, links=self._links,
                      precision=self._opts.precision, virtual_stages=self._virtual,
                      kind=self.kind, varying=self._opts.varying_shapes)
        modules = {m.stage: m.module for m in self.runner.modules}
        first = self.runner.schedule.replica_of_rank(self.srank) == 0 and self.member == 0
        with gathered(m.zero for m in self.runner.modules), first_replicas_buffers(
                modules, replicated=max(self.replicas) > 1, first=first):
            return evaluate(batches, modules, self.loss_fn, me, self._segments.loss_weight)

    @property
    def skipped(self) -> list[int]:
        """The minibatches whose update was skipped for a non-finite value (``on_nonfinite``)."""
        return list(self._kept[1] if self._runner is None else self.runner.guard.skipped)

    @property
    def events(self) -> list[Event]:
        """What this rank did, with times from :meth:`start_clock` (``record_events``)."""
        return self._kept[0] if self._runner is None else self.runner.events

    def start_clock(self) -> float:
        """Time :attr:`events` from now (``time.perf_counter()``, returned); called on every
        rank after a barrier, all ranks' events share one origin."""
        t0 = time.perf_counter()
        self.runner.start_clock(t0)
        return t0

    @counted
    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's ``state_dict`` (original keys, CPU), on every rank; drains first."""
        self._drain()
        mine = None
        first = self.runner.schedule.replica_of_rank(self.srank) == 0
        if first or self.runner.gathers_state:  # ZeRO's masters: gathered over the replicas
            mine = self.runner.final_state()  # gathers a split stage's DTensors: all its workers
            mine = mine if self.member == 0 and first else None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return self.state_keys.complete(
            {k: v for part in gathered if part is not None for k, v in part.items()})

    @counted
    def save(self, directory: str | Path) -> Path:
        """Save a checkpoint as ``directory/step-N`` (N minibatches so far); drains first."""
        self._drain()
        return checkpoint.save(Path(directory), self)

    def close(self) -> None:
        """Drain; end the process group if this Pipeline started it, else the subgroups it
        made; drop the runner and collect its cycles now, so that no ended group's gloo
        threads live on to the interpreter's exit, where they abort it (docs/design.md
        §8.5). :attr:`events` and :attr:`skipped` stay readable."""
        if self._runner is None:
            return
        if self._stopped is None:
            self._drain()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
        elif dist.is_initialized():
            end_groups(self._groups)
        self._groups = []
        self._kept = (self.events, self.skipped)  # what may still be read
        self._runner = None
        del self._links
        gc.collect()


"""A rank's stages as the runtime's :class:`~dreampipe.runtime.stage_module.StageModule`\\ s.

Each stage the rank runs is built from the model's layers under their own
names (split over workers on its mesh when the plan splits it), with the
user's optimizer, and, under an asynchronous schedule, the optimizer
settings staleness compensation gives its delay
(:mod:`dreampipe.runtime.staleness`), before any learning-rate scheduler
reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dreampipe.api.config import TrainConfig
from dreampipe.planning.plan import Plan
from dreampipe.runplan.study_epochs import study_advice
from dreampipe.runtime.block_recompute import BlockRecompute, stage_blocks
from dreampipe.runtime.fused import LinearGradients
from dreampipe.runtime.runner_options import RunnerOptions
from dreampipe.runtime.stage_module import StageModule
from dreampipe.runtime.staleness import (
    Applied,
    compensate_stage,
    compensation_delay,
    hyper_of,
    predicting,
    recompensated,
    stage_delays,
)
from dreampipe.runtime.zero import ZeroPlace
from dreampipe.scheduling.actions import Schedule
from dreampipe.splitter.chain import Layers, build_split_stage, build_stage, hold_apart

__all__ = ["agreement_note", "build_modules", "compensate_modules", "compensation_delays",
           "follow_schedulers", "study_warning"]

_log = logging.getLogger(__name__)


def build_modules(layers: Layers, plan: Plan, stages: Iterable[int], device: torch.device,
                  mesh: DeviceMesh | None, *,
                  optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                  loss_fn: Callable[..., Any], config: TrainConfig, rank: int = 0,
                  start: Callable[[Mapping[int, nn.Module]], None] | None = None,
                  firsts: Sequence[int] = ()) -> list[StageModule]:
    """One StageModule per stage in ``stages``, each with the user's ``optimizer`` and
    ``loss_fn`` and the config's weight stashing, vertical sync, gradient kernels and
    seed; a split stage's share on ``mesh``; the blocks it recomputes (a stage the plan
    recomputes whole does that instead; a stage of fewer blocks than asked recomputes
    them all); its ZeRO level (the plan's stage's, else the config's) and schedule rank
    ``rank``'s shard of it (``firsts``: each schedule rank's first process, rank order
    where empty). ``start`` sees the stages as built, before their optimizers cast or
    shard them (where tied weights take their first stage's value)."""
    spec = config.block_recompute()
    if spec is not None:
        spec = spec.for_model(*(m for _, m in layers))
    stages = list(stages)
    built: list[nn.Module] = []
    for stage in stages:
        st = plan.stages[stage]
        if st.tensor_parallel > 1:
            assert mesh is not None, "a split stage needs its mesh"
            built.append(build_split_stage(layers, st.first, st.last, st.splits, mesh, device,
                                           config.seed))
        else:
            built.append(build_stage(layers, st.first, st.last, device, config.seed))
    hold_apart(built)  # interleaving: a weight tied across the rank's stages, a copy each
    if start is not None:
        start(dict(zip(stages, built, strict=True)))
    modules = []
    for stage, module in zip(stages, built, strict=True):
        st = plan.stages[stage]
        split = st.tensor_parallel > 1
        modules.append(StageModule(
            module, optimizer, stage=stage, input_grad=stage > 0, stash=config.stash,
            vertical_sync=config.vertical_sync, loss_fn=loss_fn,
            linear=LinearGradients.AUTOGRAD if split
            else LinearGradients.of(config.fused_accumulation), recompute=st.recompute,
            precision=config.number_formats,
            blocks=None if st.recompute else _stage_spec(spec, module),
            zero=_zero_place(plan, stage, rank, config.zero, firsts),
        ))
    return modules


def _zero_place(plan: Plan, stage: int, rank: int, level: int, firsts: Sequence[int]
                ) -> ZeroPlace | None:
    """Stage ``stage``'s ZeRO level and ``rank``'s shard of it: its place among the
    stage's replicas by process (``firsts``: each schedule rank's first; rank order where
    empty), as its all-reduce group numbers them; None at level 0 or when the stage is
    not replicated (interleaving, one replica)."""
    st, level = plan.stages[stage], plan.zero_levels(level)[stage]
    if level == 0 or st.replicas == 1 or rank not in st.ranks:
        return None
    order = sorted(st.ranks, key=lambda r: firsts[r]) if firsts else list(st.ranks)
    return ZeroPlace(level, order.index(rank), st.replicas)


def _stage_spec(spec: BlockRecompute | None, stage: nn.Module) -> BlockRecompute | None:
    """``spec`` for a stage: its first ``k`` blocks capped at those it holds; None where it
    holds none."""
    if spec is None or spec.block is None:
        return None
    held = len(stage_blocks(stage, spec.block))
    if held == 0:
        return None
    return spec if spec.blocks is None else BlockRecompute(min(spec.blocks, held),
                                                          block=spec.block)


def compensate_modules(modules: list[StageModule], schedule: Schedule | None,
                       vertical_sync: bool, *, enabled: bool, advise: bool, uniform: bool,
                       weighed: bool = False) -> dict[int, Applied]:
    """Staleness compensation of every module's optimizer for its delay in ``schedule``
    (None: a synchronous one, which has no delays); ``advise``: warn, once, when a delay
    is large for the settings (``weighed``: say it, not warn, where ``schedule="auto"``
    chose the schedule weighing those epochs); ``uniform``: every stage takes the deepest
    delay's settings (weights tied across stages). What it changed, by stage. With
    ``enabled``, a delayed stage whose optimizer compensates by prediction (Adam's) runs
    on predicted weights (:func:`~dreampipe.runtime.staleness.predicting`,
    :mod:`dreampipe.runtime.versions`)."""
    delays = (stage_delays(schedule, vertical_sync)
              if schedule is not None and not schedule.kind.synchronous else None)
    for m in modules:
        groups = m.optimizer.param_groups if m.optimizer is not None else []
        wants = (schedule is not None and delays is not None and delays[m.stage] > 0
                 and any(predicting(schedule.kind, hyper_of(g), compensate=enabled, stash=True)
                         for g in groups))
        m.versions.predict = wants and m.stash
        if wants and not m.stash and advise and delays is not None:
            _log.warning("stage %d trains %d updates stale with Adam's settings uncompensated: "
                         "weight prediction, their compensation, runs on stashed weights; "
                         "drop stash=False (PipeDream's demonstration of no stashing)",
                         m.stage, delays[m.stage])
        if m.versions.predict:
            _log.info("stage %d runs on its weights predicted for the update its gradient goes "
                      "into (staleness compensation)", m.stage)
    if advise and schedule is not None and modules and modules[0].optimizer is not None:
        warning = study_warning(modules[0].optimizer, schedule, weighed)
        if warning is not None:
            _log.log(logging.INFO if weighed else logging.WARNING, "%s", warning)
    return {m.stage: compensate_stage(m.optimizer, schedule, m.stage, vertical_sync=vertical_sync,
                                      enabled=enabled, advise=advise and m is modules[0],
                                      uniform=uniform, delays=delays)
            for m in modules}


def compensation_delays(schedule: Schedule | None, stages: Sequence[int], vertical_sync: bool,
                        *, enabled: bool, uniform: bool) -> dict[int, int | None]:
    """The delay each of ``stages`` is compensated for in ``schedule`` (None: a synchronous
    one), None for every stage where the run compensates none
    (:func:`~dreampipe.runtime.staleness.compensation_delay`)."""
    if not enabled or schedule is None or schedule.kind.synchronous:
        return dict.fromkeys(stages)
    delays = stage_delays(schedule, vertical_sync)
    return {s: compensation_delay(delays, s, uniform) for s in stages}


def follow_schedulers(applied: dict[int, Applied], delays: dict[int, int | None]
                      ) -> Callable[[StageModule], None]:
    """What to call on a stage after its learning-rate scheduler was built and after each
    of its steps: a scheduler that sets the momentum anew (OneCycleLR, CyclicLR) would undo
    the compensation for the stage's delay (``delays``, :func:`compensation_delays`), so the
    value it set is compensated again, and ``applied`` (which checkpoints carry) says so
    (:func:`~dreampipe.runtime.staleness.recompensated`)."""
    def follow(module: StageModule) -> None:
        delay = delays.get(module.stage)
        if delay is None or module.optimizer is None:
            return
        groups = module.optimizer.param_groups
        applied[module.stage] = tuple(recompensated(g, pair, delay) for g, pair in
                                      zip(groups, applied[module.stage], strict=True))
    return follow


def agreement_note(schedule: Schedule | None, opts: RunnerOptions) -> str | None:
    """What the ranks' agreement before every update (``opts.steps_agree``) costs an
    asynchronous ``schedule`` of several stages: they wait for each other's backwards
    (docs/design.md §9); None where it costs nothing of the kind."""
    if schedule is None or schedule.kind.synchronous or schedule.num_stages < 2 or \
            not opts.steps_agree:
        return None
    return (f"{schedule.kind.value} with max_grad_norm (or a loss scale, or skipping): every "
            "update waits for every stage's backward of it, so the stages wait for each "
            "other and overlap less; the run's prediction and schedule='auto' count it")


def study_warning(optimizer: torch.optim.Optimizer, schedule: Schedule,
                  weighed: bool = False) -> str | None:
    """What the convergence study says of training with ``optimizer`` on ``schedule``, when
    it says an asynchronous schedule at that depth misses data parallelism's epochs by
    more than its bound (:func:`~dreampipe.runplan.study_epochs.study_advice`;
    ``weighed``: ``schedule="auto"`` chose it with those epochs counted)."""
    if schedule.kind.synchronous:
        return None
    hyper = hyper_of(optimizer.param_groups[0])
    family = None if hyper is None else "adam" if hyper.adaptive else "sgd"
    return study_advice(schedule.kind, schedule.num_stages, family, weighed=weighed)

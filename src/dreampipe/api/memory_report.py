"""A Pipeline rank's peak memory beside its prediction (``TrainConfig(measure_memory=True)``).

The rank's :class:`~dreampipe.runtime.memory_meter.Meter` starts when the Pipeline
starts (or earlier, by whoever measured first in the process: ``dreampipe train``
starts it before it builds the layers), counting the weights of the rank's stages
that already existed then, and counts what the Pipeline's methods compute
(:func:`counted`). The figure is what
:func:`~dreampipe.runtime.memory.predict_memory` predicts of the tensors: the stage's
weights, versions, gradients, optimizer state and activations. The prediction profiles
the model once, on rank 0, in the run's number formats, and counts the optimizer's
state as the user's optimizer holds it (Adam's two copies, SGD's momentum or none).
docs/design.md §5.4.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dreampipe.api.config import TrainConfig
from dreampipe.errors import ConfigError
from dreampipe.planning.memory_terms import SENDS_KEPT
from dreampipe.planning.plan import Plan
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runtime.memory import TrainingChoices, counted_twice, predict_memory
from dreampipe.runtime.memory_meter import MemoryUse, Meter, current_meter, start_measuring
from dreampipe.runtime.optimizer_step import NO_STEP_BYTES, StepBytes, measure_step_bytes
from dreampipe.runtime.runner_options import OptimizerKind
from dreampipe.runtime.stage_module import StageModule
from dreampipe.runtime.staleness import hyper_of
from dreampipe.scheduling.actions import Schedule
from dreampipe.splitter.chain import Layers

__all__ = ["MemoryReport", "counted", "counting", "measured", "predicted_memory", "start",
           "training_choices"]

_R = TypeVar("_R")


@dataclass(frozen=True)
class MemoryReport:
    """One rank's ``measured`` peak bytes of tensors (with its stages' weights that
    existed before measuring started) and the ``predicted`` bytes of its stages (one, or
    an interleaved rank's several); ``stage`` is its first."""

    rank: int
    stage: int
    measured: int
    predicted: int
    use: MemoryUse

    @property
    def ratio(self) -> float:
        """``measured / predicted``."""
        return self.measured / self.predicted if self.predicted else float("inf")


def training_choices(config: TrainConfig, modules: Sequence[StageModule]) -> TrainingChoices:
    """What memory depends on among ``config`` and the optimizer the rank's ``modules``
    hold: its state tensors counted in copies of what it steps (the weights, their
    32-bit masters, or this replica's chunks under ZeRO)."""
    state = weights = 0
    step = NO_STEP_BYTES
    hyper = None
    for m in modules:
        if m.optimizer is None:
            continue
        if step is NO_STEP_BYTES:  # a rank's stages build theirs with one factory
            step = _step_bytes(m.optimizer)
            # how the runtime compensates (weight prediction keeps copies): as it reads it
            hyper = hyper_of(m.optimizer.param_groups[0]) if m.optimizer.param_groups else None
        weights += sum(p.numel() * p.element_size()  # a chunk may view a whole weight
                       for g in m.optimizer.param_groups for p in g["params"])
        state += sum(v.numel() * v.element_size() for per in m.optimizer.state.values()
                     for v in per.values() if isinstance(v, Tensor) and v.dim() > 0)
    adaptive = hyper is not None and hyper.adaptive
    return TrainingChoices(optimizer=OptimizerKind.ADAM if adaptive else OptimizerKind.SGD,
                           momentum=0.0 if hyper is None or adaptive else hyper.momentum,
                           stash=config.stash,
                           vertical_sync=config.vertical_sync, compensate=config.compensate,
                           precision=config.number_formats,
                           recompute_blocks=config.recompute_blocks, zero=config.zero,
                           state_copies=state / weights if weights else 0.0,
                           step_bytes=step)


def _step_bytes(optimizer: torch.optim.Optimizer) -> StepBytes:
    """The step temporaries of ``optimizer``'s kind and settings, stepped on the device of
    its parameters (:func:`~dreampipe.runtime.optimizer_step.measure_step_bytes`)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")
    kind, settings = type(optimizer), dict(optimizer.defaults)
    takes = inspect.signature(kind).parameters  # defaults may hold more (AdamW's flags)
    if not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        settings = {k: v for k, v in settings.items() if k in takes}
    return measure_step_bytes(lambda ps: kind(ps, **settings), device)


def predicted_memory(profile: Callable[[], LayerGraph], plan: Plan, schedule: Schedule,
                     choices: TrainingChoices, block: str | None, at: int) -> tuple[int, ...]:
    """Each schedule rank's predicted bytes, its stages' less what their sum counts twice
    (:func:`~dreampipe.runtime.memory.counted_twice`), each with its own optimizer's
    ``choices`` (gathered from every rank, ``at`` its schedule rank: a frozen stage has
    none, a factory may give stages others): rank 0 profiles (``profile``) and predicts,
    every rank gets them (a collective)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (at, choices))
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        graph = profile()
        mine = {r: dataclasses.replace(c, block=block) for r, c in gathered}
        priced: dict[TrainingChoices, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for chosen in set(mine.values()):
            priced[chosen] = (predict_memory(graph, plan, schedule, chosen, library=False),
                              counted_twice(graph, plan, schedule, chosen, library=False))
        out_ = []
        for rank in range(schedule.num_ranks):
            stages, twice = priced[mine[rank]]
            out_.append(sum(stages[s] for s in schedule.stages_of_rank(rank)) - twice[rank])
        box[0] = tuple(out_)
    dist.broadcast_object_list(box, src=0)
    out: tuple[int, ...] = box[0]
    return out


def start(config: TrainConfig, layers: Sequence[nn.Module], device: torch.device
          ) -> Meter | None:
    """With ``measure_memory``: this process's meter (the one it started already, else
    a new one counting the rank's ``layers``' weights and buffers, which exist before
    it), else None."""
    if not config.measure_memory:
        return None
    taken = current_meter()
    if taken is not None:
        return taken
    meter = start_measuring(device)
    meter.adopt(t for layer in layers for t in (*layer.parameters(), *layer.buffers()))
    return meter


def counting(meter: Meter | None) -> AbstractContextManager[None]:
    """Within, ``meter`` counts what the rank computes (nothing without a meter)."""
    return meter.counting() if meter is not None else nullcontext()


def counted(method: Callable[..., _R]) -> Callable[..., _R]:
    """A Pipeline method whose computation its meter (``self._meter``) counts."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> _R:
        with counting(self._meter):
            return method(self, *args, **kwargs)
    return run


def measured(meter: Meter | None, rank: int, modules: Sequence[StageModule],
             config: TrainConfig, plan: Plan, layers: Layers,
             schedule: Callable[[int], Schedule], profile: Callable[[], LayerGraph],
             minibatches: int,
             whole: Callable[[], AbstractContextManager[None]] = nullcontext,
             schedule_rank: int | None = None) -> MemoryReport:
    """The rank's report: its ``meter``'s peak, beside its stage's
    prediction on ``schedule(horizon)`` (long enough to fill the pipeline and the kept
    sends), profiled by ``profile`` on rank 0 within ``whole()`` (every rank enters it,
    after its peak is read: ZeRO-3's weights gathered), found at ``schedule_rank`` (the
    schedule's rank; default ``rank``); a ConfigError without a meter."""
    if meter is None:
        raise ConfigError("memory() reports what a Pipeline made with "
                          "TrainConfig(measure_memory=True) measured; set it", "measure_memory")
    stage = modules[0].stage
    use = meter.finish(rank, stage)
    fill = max(plan.workers_used, plan.stages[0].replicas * plan.in_flight[0])
    horizon = min(max(minibatches, 1), SENDS_KEPT + 2 * fill)
    spec = config.block_recompute()
    block = spec.for_model(*(m for _, m in layers)).block if spec is not None else None
    at = rank if schedule_rank is None else schedule_rank
    with whole():
        predicted = predicted_memory(profile, plan, schedule(horizon),
                                     training_choices(config, modules), block, at)
    return MemoryReport(rank, stage, use.used, predicted[at], use)

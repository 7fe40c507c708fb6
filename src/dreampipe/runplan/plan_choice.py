"""The run's plan: the one place a run's plan and schedule are chosen.

``Pipeline(plan="auto")``, ``dreampipe train``, ``demo`` and ``bench`` all
call :func:`choose_plan` with a profile, the workers' topology and a
:class:`PlanAsk`, and run the :class:`RunPlan` it returns. A given plan is
kept; a forced partition is priced (its cuts the fastest where only the
replica counts are forced); otherwise the planner plans. With
``semantics`` (``schedule="auto"``) the simulator also picks the fastest
schedule of those semantics that fits the memory; when the planner is free
it does so over the planner's plan of each number of stages, since a
synchronous schedule pays for depth (docs/design.md §7.10).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass

from dreampipe.errors import ConfigError, PlanError
from dreampipe.machine.calibration import LocalCalibration
from dreampipe.planning.config_string import parse_stage_bounds, stages_from_config
from dreampipe.planning.memory_terms import STATELESS, OptimizerTerms
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.placement import Placement
from dreampipe.planning.plan import Plan
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runplan.schedule_choice import (
    EFFECTIVE,
    ScheduleChoice,
    Semantics,
    choose_schedule,
)
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.interleave import interleaved_plan

__all__ = ["PlanAsk", "RunPlan", "choose_plan", "forced_partition"]

log = logging.getLogger(__name__)

#: The most partitions priced to place the cuts of a forced config.
_MAX_CUT_CHOICES = 20_000


@dataclass(frozen=True, kw_only=True)
class PlanAsk:
    """What a run asks of its plan.

    ``given`` is used as it is. ``config`` (``"2-1"``, ``"straight"``) and
    ``stages`` (``"0,4"``) force the replicas per stage and the first layers
    (:func:`forced_partition`). ``virtual_stages`` > 1 cuts the layers into
    ``workers x v`` balanced stages, placed as ``placement`` says (the loop of
    interleaved 1F1B, or the V of zbv and dualpipev). ``semantics`` asks
    for the schedule too, simulated with ``microbatches`` per minibatch (None: the search's
    own) of ``minibatch_size`` samples (None: the profile's batch).
    ``memory_bytes`` is each worker's limit (None: none), within which the schedules hold
    what ``optimizer`` holds beside the weights; ``zero`` the run's ZeRO level,
    which the schedule's simulation prices, as it prices ``steps_agree``: the ranks agree
    before every update (a run that clips by the global norm, say). ``machine`` (on
    ``nodes`` nodes) is the calibration of the workers that run it, whose costs around the
    layers the schedules' simulation prices as the run's prediction does (None: the
    profile's alone).
    """

    workers: int
    given: Plan | None = None
    config: str | None = None
    stages: str | None = None
    virtual_stages: int = 1
    placement: Placement = Placement.LOOP
    semantics: Semantics | None = None
    microbatches: int | None = None
    minibatch_size: int | None = None
    memory_bytes: int | None = None
    optimizer: OptimizerTerms = STATELESS
    allow_fewer_workers: bool = True
    zero: int = 0
    steps_agree: bool = False
    machine: LocalCalibration | None = None
    nodes: int = 1

    def __post_init__(self) -> None:
        # a plan file with a partition is refused where the file is named (train's flags)
        assert self.given is None or not (self.config or self.stages)
        if self.virtual_stages > 1 and self.stages:
            raise ConfigError(
                f"virtual_stages={self.virtual_stages} cuts the model into positions x "
                f"{self.virtual_stages} stages itself; leave out stages={self.stages!r}, "
                "or give a plan", "virtual_stages", "stages")
        if self.virtual_stages > 1 and self.config and self.placement is not Placement.LOOP:
            raise ConfigError(
                f"config={self.config!r} with virtual_stages={self.virtual_stages} replicates "
                "positions of interleaved 1F1B's loop; the V places its stages otherwise: "
                f"leave out config={self.config!r}, or use the interleaved-1f1b schedule",
                "virtual_stages", "config")

    @property
    def planner_free(self) -> bool:
        """Nothing forced: the planner picks the stages and their replicas."""
        return (self.given is None and self.config is None and self.stages is None
                and self.virtual_stages == 1)


@dataclass(frozen=True)
class RunPlan:
    """The plan a run runs, the schedule chosen for it (None unless ``semantics`` was
    asked), and the lines that say why, for the user."""

    plan: Plan
    schedule: ScheduleChoice | None = None
    lines: tuple[str, ...] = ()

    @property
    def chosen(self) -> tuple[ScheduleKind, int] | None:
        """The chosen schedule and its microbatches per minibatch, if one was chosen."""
        return None if self.schedule is None else (self.schedule.kind,
                                                   self.schedule.microbatches)


def choose_plan(graph: LayerGraph, topology: Topology, ask: PlanAsk) -> RunPlan:
    """The plan (and, with ``ask.semantics``, the schedule) a run on ``topology`` runs
    (module doc); ``topology`` has ``ask.workers`` workers."""
    if ask.semantics is not None and ask.planner_free:
        return _fastest_pair(graph, topology, ask, ask.semantics)
    plan = _plan(graph, topology, ask)
    if ask.semantics is None:
        return RunPlan(plan)
    choice = _schedule(graph, plan, topology, ask, ask.semantics)
    if plan.virtual_stages > 1:  # several stages per worker, placed for the one chosen
        plan = plan.placed(choice.kind.placement)
    return RunPlan(plan, choice, _schedule_lines(ask.semantics, choice))


def forced_partition(
    num_layers: int, workers: int, config: str | None, stages: str | None
) -> tuple[list[int] | None, list[int]] | None:
    """``(bounds, replicas)`` forced by ``config``/``stages``, or None to plan.

    ``config`` (``"2-1"``) and ``stages`` (``"0,4"``) give one replica count
    and one first layer per stage; ``stages`` alone means one worker per
    stage. ``config`` alone leaves the cuts to be priced (bounds None),
    except for one stage, which starts at layer 0; ``"straight"`` alone is
    one stage per worker.
    """
    if config is None and stages is None:
        return None
    if stages is None:
        assert config is not None
        replicas = stages_from_config(config, workers)
        if len(replicas) > num_layers:
            raise ConfigError(
                f"config={config!r} has {len(replicas)} stages but the model has "
                f"{num_layers} layers; use at most {num_layers} stages", "config",
            )
        bounds = None if len(replicas) > 1 else [0]
    else:
        bounds = parse_stage_bounds(stages, num_layers)
        replicas = stages_from_config(config, len(bounds)) if config else [1] * len(bounds)
        if len(replicas) != len(bounds):
            raise ConfigError(
                f"config={config!r} has {len(replicas)} stages but stages={stages!r} starts "
                f"{len(bounds)}; give one first layer per stage", "config", "stages",
            )
    if sum(replicas) != workers:
        raise ConfigError(
            f"config={config or 'straight'!r} needs {sum(replicas)} workers, not {workers}; "
            f"use workers={sum(replicas)}", "config", "workers",
        )
    return bounds, replicas


def _plan(graph: LayerGraph, topology: Topology, ask: PlanAsk,
          max_stages: int | None = None) -> Plan:
    """The given plan, the interleaved cut, the forced partition priced, or the planner's."""
    from dreampipe.planning import planner

    if ask.given is not None:
        return ask.given
    if ask.virtual_stages > 1:  # ``config``: each position's replicas
        positions = None if ask.config is None else stages_from_config(ask.config, ask.workers)
        return interleaved_plan(graph, ask.workers, ask.virtual_stages,
                                positions).placed(ask.placement)
    forced = forced_partition(len(graph.layers), ask.workers, ask.config, ask.stages)
    if forced is None:
        return planner.plan_pipeline(graph, topology, PlanOptions(
            allow_fewer_workers=ask.allow_fewer_workers, memory_bytes=ask.memory_bytes,
            max_stages=max_stages, recompute=ask.memory_bytes is not None,
            optimizer=ask.optimizer))
    bounds, replicas = forced
    if bounds is not None:
        return planner.evaluate_plan(graph, topology, bounds, replicas,
                                     memory_bytes=ask.memory_bytes, optimizer=ask.optimizer)
    return _best_cuts(graph, topology, replicas, ask.optimizer, ask.memory_bytes)


def _best_cuts(graph: LayerGraph, topology: Topology, replicas: list[int],
               optimizer: OptimizerTerms, memory_bytes: int | None = None) -> Plan:
    """The fastest partition into ``len(replicas)`` stages with these replica counts
    (memory with what ``optimizer`` holds beside the weights; ``memory_bytes``: the limit
    the stages' minibatches in flight are chosen for, as the planner chooses them)."""
    from dreampipe.planning import planner

    n, k = len(graph.layers), len(replicas)
    if math.comb(n - 1, k - 1) > _MAX_CUT_CHOICES:
        raise ConfigError(
            f"config={'-'.join(map(str, replicas))!r} on {n} layers leaves "
            f"{math.comb(n - 1, k - 1)} ways to cut; give the first layer of each stage "
            "with stages (e.g. 0,4)", "stages",
        )
    plans = (planner.evaluate_plan(graph, topology, [0, *cuts], replicas,
                                   memory_bytes=memory_bytes, optimizer=optimizer)
             for cuts in itertools.combinations(range(1, n), k - 1))
    best = min(plans, key=lambda plan: plan.time_per_minibatch_s)
    log.info("config %s: the fastest cuts start stages at %s", best.config,
             [st.first for st in best.stages])
    return best


def _schedule(graph: LayerGraph, plan: Plan, topology: Topology, ask: PlanAsk,
              semantics: Semantics) -> ScheduleChoice:
    """The fastest schedule of ``semantics`` on ``plan`` that fits, each candidate's
    microbatch priced at its share of the profile's batch."""
    share = 1.0 if ask.minibatch_size is None or not graph.batch_size else (
        graph.batch_size / ask.minibatch_size)
    return choose_schedule(graph, plan, topology, semantics, ask.memory_bytes,
                           ask.microbatches, zero=ask.zero, steps_agree=ask.steps_agree,
                           profile_share=share,
                           optimizer=ask.optimizer,
                           minibatch_size=ask.minibatch_size, machine=ask.machine,
                           nodes=ask.nodes)


def _stage_plans(graph: LayerGraph, topology: Topology, ask: PlanAsk, k: int,
                 semantics: Semantics) -> list[Plan]:
    """The planner's plans of at most ``k`` stages: within the memory, priced as
    PipeDream holds it, and, where ``semantics`` allows synchronous schedules (which hold
    less), also without the limit, for the schedule's own simulation to judge."""
    plans, failed = [], None
    limits = [ask] if ask.memory_bytes is None or semantics is Semantics.ASYNC else [
        ask, dataclasses.replace(ask, memory_bytes=None)]
    for limited in limits:
        try:
            plans.append(_plan(graph, topology, limited, max_stages=k))
        except PlanError as exc:  # no plan of so few stages fits: more may
            failed = failed or exc
    if not plans:
        assert failed is not None
        raise failed
    return plans


def _fastest_pair(graph: LayerGraph, topology: Topology, ask: PlanAsk,
                  semantics: Semantics) -> RunPlan:
    """The fastest (plan, schedule) of ``semantics`` over the planner's plans of at most
    ``k`` stages, ``k`` in ``1 .. workers`` (the distinct plans), that fits the memory."""
    most = min(ask.workers, len(graph.layers))
    tried: dict[str, tuple[Plan, ScheduleChoice]] = {}
    seen: set[str] = set()
    lines: list[str] = []
    for k in range(1, most + 1):
        try:
            plans = _stage_plans(graph, topology, ask, k, semantics)
        except PlanError as exc:
            lines.append(f"<= {k} stages: none fits ({exc})")
            continue
        for plan in plans:
            name = _named(plan)
            if name in seen:
                continue
            seen.add(name)
            try:
                tried[name] = (plan, _schedule(graph, plan, topology, ask, semantics))
            except ConfigError as exc:  # no schedule of these semantics fits its memory
                lines.append(f"{name:<12} not kept: {exc}")
    if not tried:
        raise ConfigError(f"no plan of 1 to {most} stages has a {semantics.value} "
                          "schedule that fits: " + "; ".join(lines), "memory_bytes")
    best, choice = max(tried.values(), key=lambda pair: _rate(pair[1]))
    for config, (plan, got) in tried.items():
        verdict = "kept: the fastest" if plan is best else "slower"
        lines.append(f"{config:<12} {got.kind.value:<16} {_rate(got):10.3f} "
                     f"minibatches/s{_WEIGHED.get(semantics, '')}: {verdict}")
    head = (f"plan auto ({semantics.value}): the planner's plan of each number of stages, "
            "each with its fastest schedule:")
    return RunPlan(best, choice, (head, *(f"  {x}" for x in lines),
                                  *_schedule_lines(semantics, choice)))


def _named(plan: Plan) -> str:
    """The plan's config, with its stages' first layers: two plans of one config may cut
    the layers apart differently (within a memory limit, and without)."""
    firsts = ",".join(str(st.first) for st in plan.stages)
    return plan.config if len(plan.stages) == 1 else f"{plan.config} @{firsts}"


#: How the rates of ``semantics="any"`` are weighed, said after them.
_WEIGHED = {Semantics.ANY: " effective"}


def _schedule_lines(semantics: Semantics, choice: ScheduleChoice) -> tuple[str, ...]:
    best = (f"the soonest to the target ({EFFECTIVE})" if semantics is Semantics.ANY
            else "the fastest")
    return (f"schedule auto ({semantics.value}): {choice.kind.value}, {best} that fits, "
            f"with {choice.microbatches} microbatches per minibatch:",
            *(f"  {x}" for x in choice.reasons()))


def _rate(choice: ScheduleChoice) -> float:
    """The chosen candidate's rate, weighed by its epochs to target where it was."""
    return next(c.to_target for c in choice.candidates if c.kind is choice.kind)

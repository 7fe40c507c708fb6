"""``--schedule auto``: the fastest schedule for a plan that fits memory and the semantics.

The user asks for synchronous semantics (every update's gradients from the
weights of the update before, as one process trains: 1f1b-flush, zb-h1,
zb-h2, gpipe), asynchronous ones (stale weights: pipedream, 2bw), or any, where
each rate is divided by the epochs the convergence study predicts (time to
target, :mod:`.study_epochs`). Each candidate of that kind that runs on the plan's
stages is simulated on the profile for a few minibatches; a candidate whose peak
memory on some worker exceeds the limit is dropped, and the fastest of the others
kept. Every
candidate's line says why it was kept or dropped. A plan of several stages per
worker (``dreampipe plan --virtual-stages``) has candidates of its own, all
synchronous (:data:`SEVERAL`): interleaved 1F1B, and where it runs 2 a worker zbv and
dualpipev, simulated on the plan re-placed in a V; ``plan.placed(choice.kind.placement)``
is then the plan the chosen one runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from dreampipe.errors import ConfigError
from dreampipe.machine.calibration import LocalCalibration, local_costs, measured_machine
from dreampipe.planning.costs import GPIPE_MICROBATCHES_PER_STAGE, RangeCosts
from dreampipe.planning.memory_terms import STATELESS, OptimizerTerms
from dreampipe.planning.placement import Placement
from dreampipe.planning.plan import Plan
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import format_bytes
from dreampipe.runplan.study_epochs import ROWS, StudyRow, epochs_factor
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout, default_microbatches
from dreampipe.scheduling.unshard import ASYNC_REASON, SHARDED_LEVEL
from dreampipe.simulation.action_costs import costs_from_profile
from dreampipe.simulation.simulator import simulate_schedule
from dreampipe.simulation.zero_costs import with_zero

__all__ = ["CANDIDATES", "EFFECTIVE", "MAX_2BW_MICROBATCHES", "SEVERAL", "STAND_IN", "Candidate",
           "ScheduleChoice", "Semantics", "check_semantics", "choose_schedule", "held_by_optimizer",
           "microbatch_counts", "small_profile_batch"]


class Semantics(Enum):
    SYNC = "sync"
    ASYNC = "async"
    #: Both, weighed by their predicted time to target (:mod:`.study_epochs`).
    ANY = "any"


def check_semantics(kind: ScheduleKind, semantics: Semantics) -> None:
    """Refuse a named schedule beside the semantics of the other kind: one of the two is
    a mistake, and which one only the user knows."""
    if semantics is not Semantics.ANY and kind.synchronous != (semantics is Semantics.SYNC):
        runs = "synchronous" if kind.synchronous else "asynchronous (stale weights)"
        raise ConfigError(f"schedule={kind.value} is {runs}, and semantics={semantics.value} "
                          "asks for the other; drop one of them", "schedule", "semantics")


_S = ScheduleKind
#: Candidates per semantics, in the order they are tried (ties keep the earlier).
CANDIDATES = {
    Semantics.SYNC: (_S.ZB_H1, _S.ZB_H2, _S.FLUSH, _S.GPIPE),
    Semantics.ASYNC: (_S.TWO_BW, _S.PIPEDREAM),
    Semantics.ANY: (_S.ZB_H1, _S.ZB_H2, _S.FLUSH, _S.GPIPE, _S.TWO_BW, _S.PIPEDREAM),
}
#: Candidates on a plan of several stages per worker (synchronous, all): the V ones where
#: it runs 2 a worker.
SEVERAL = (_S.INTERLEAVED, _S.ZBV, _S.DUALPIPEV)
#: Candidates the runtime does not run on a plan with a stage split over workers (their
#: split backward and two-version stashing are not built for sharded weights).
_NOT_ON_SPLITS = frozenset((_S.ZB_H1, _S.ZB_H2, _S.TWO_BW))
#: What stands in for ``auto`` until the choice is made (profiling, early checks): a
#: schedule of each semantics that splits minibatches, as most candidates do.
STAND_IN = {Semantics.SYNC: _S.FLUSH, Semantics.ASYNC: _S.TWO_BW, Semantics.ANY: _S.FLUSH}
#: Minibatches each candidate is simulated for: enough that warm-up and drain
#: do not decide the order.
_MINIBATCHES = 8
#: What ``semantics="any"`` compares, said where it reports.
EFFECTIVE = ("effective minibatches/s: the simulated rate over the epochs to the target as "
             "a multiple of data parallelism's, from dreampipe's convergence study")
#: Relative difference in rate below which two candidates tie.
_TIE = 1e-9
#: The most microbatches per minibatch 2bw is simulated with.
MAX_2BW_MICROBATCHES = 1024


@dataclass(frozen=True)
class Candidate:
    """One schedule simulated on the plan with ``microbatches`` per minibatch: its
    rate, its worst worker's memory, and whether it fits the limit (always, with
    no limit); ``why_not`` says why it was not simulated. Under ``semantics="any"``,
    ``epochs`` is the epochs to target it is predicted to need as a multiple of data
    parallelism's (None: not weighed), for the reason ``study``."""

    kind: ScheduleKind
    microbatches: int
    minibatches_per_s: float
    peak_memory_bytes: int
    fits: bool
    why_not: str = ""
    epochs: float | None = None
    study: str = ""

    @property
    def to_target(self) -> float:
        """What the choice maximises: the rate, over ``epochs`` where weighed (0: never)."""
        if self.epochs is None:
            return self.minibatches_per_s
        return 0.0 if math.isinf(self.epochs) else self.minibatches_per_s / self.epochs

    def line(self, chosen: bool, lone: bool = False, limited: bool = True) -> str:
        """Its rate, memory and verdict (``lone``: the only candidate, asked by name;
        ``limited``: weighed against a memory limit)."""
        if self.why_not:
            return f"{self.kind.value:<16} not tried: {self.why_not}"
        weighed = self.epochs is not None
        fit = " that fits" if limited else ""
        if not self.fits:
            verdict = "does not fit the memory limit"
        elif lone:
            verdict = "fits"
        elif chosen:
            verdict = f"chosen: the {'soonest to the target' if weighed else 'fastest'}{fit}"
        else:
            verdict = ("fits, " if limited else "") + ("no sooner" if weighed else "no faster")
        said = (f"{self.kind.value:<16} {self.minibatches_per_s:10.3f} minibatches/s, peak "
                f"{format_bytes(self.peak_memory_bytes):>10} per worker")
        if self.epochs is not None:
            epochs = ("never reaches the target" if math.isinf(self.epochs) else
                      f"{self.epochs:.2f}x dp's epochs")
            said += f"; {epochs} ({self.study}): {self.to_target:.3f} effective"
        return said if lone and not limited else f"{said}: {verdict}"


@dataclass(frozen=True)
class ScheduleChoice:
    """The kept schedule, the microbatches per minibatch it was simulated with (1 for
    pipedream), every candidate in the order tried, and the memory limit they were held
    to (None: none)."""

    kind: ScheduleKind
    microbatches: int
    candidates: tuple[Candidate, ...]
    memory_bytes: int | None = None

    def reasons(self) -> list[str]:
        """One line per candidate: its rate, memory, and why it was kept or dropped (a
        lone candidate, a schedule asked by name: whether it fits)."""
        limited = self.memory_bytes is not None
        if len(self.candidates) == 1:
            return [self.candidates[0].line(False, lone=True, limited=limited)]
        return [c.line(c.kind is self.kind, limited=limited) for c in self.candidates]


def held_by_optimizer(graph: LayerGraph, plan: Plan, optimizer: OptimizerTerms,
                      weights: Sequence[float]) -> tuple[float, ...]:
    """What each stage of ``plan`` (``weights`` bytes of weights on a worker) holds for
    ``optimizer`` beside its weights and their gradient: its state, and the bound on its
    step's temporaries the planner counts (:attr:`~dreampipe.planning.costs.RangeCosts.
    step_held`; a split stage's over each worker's share of its layers), so that a schedule
    said to fit also passes the run's own check, which counts the step too."""
    from dreampipe.planning.split_stage import split_step_bytes

    step = RangeCosts.of(graph, optimizer).step_held
    return tuple(optimizer.state_copies * w + (
        split_step_bytes(graph.layers[st.first:st.last + 1], st.splits,
                         st.tensor_parallel, optimizer)
        if st.tensor_parallel > 1 else float(step[st.first, st.last]))
        for st, w in zip(plan.stages, weights, strict=True))


def _dividing(m: int, widest: int, batch: int | None) -> int:
    """``m`` microbatches, or where they do not divide ``batch`` samples the nearest count,
    whole rounds of ``widest`` replicas, that does: the most below ``m``, else the fewest
    above it (``m`` itself where none does: the run then says why)."""
    if not batch or batch % m == 0:
        return m
    whole = [d for d in range(widest, batch + 1, widest) if batch % d == 0]
    below = [d for d in whole if d <= m]
    return max(below) if below else min(whole, default=m)


def choose_schedule(
    graph: LayerGraph, plan: Plan, topology: Topology, semantics: Semantics,
    memory_bytes: int | None = None, microbatches: int | None = None, *, zero: int = 0,
    study: Sequence[StudyRow] = ROWS, kinds: Sequence[ScheduleKind] = (),
    steps_agree: bool = False, profile_share: float = 1.0,
    optimizer: OptimizerTerms = STATELESS,
    minibatch_size: int | None = None, machine: LocalCalibration | None = None, nodes: int = 1,
) -> ScheduleChoice:
    """The fastest candidate of ``semantics`` (module doc) on ``plan`` that fits
    ``memory_bytes`` per worker (None: no limit). ``microbatches`` per minibatch
    for the microbatched schedules; by default :func:`~dreampipe.scheduling.
    microbatch_layout.default_microbatches` (GPipe's 4 per stage, whole rounds of replicas);
    2bw's rounded up to whole rounds of every stage's replicas, and not tried
    when that takes more than :data:`MAX_2BW_MICROBATCHES`; interleaved-1f1b's up to a
    multiple of the workers, dualpipev's to at least one per stage. Each is simulated with the
    stages' ZeRO levels (the run's ``zero``, or a stage's own; :mod:`~dreampipe.simulation.
    zero_costs`). Under ``semantics="any"`` each is weighed by the epochs the convergence
    ``study`` predicts it needs (:mod:`.study_epochs`), and the soonest to the target kept.
    ``kinds``: the candidates to try instead of the semantics' (a schedule asked by name);
    ``steps_agree``: the ranks agree before every update (a run that clips by the global
    norm), which holds the asynchronous schedules' stages to each other's backwards.
    ``profile_share``: the share of a minibatch ``graph`` was profiled at (1/4: a quarter),
    so that each candidate's microbatch is priced at its own size and its rate counts
    minibatches; ``optimizer``: what the optimizer holds beside the weights, its state (Adam
    2 copies of them) and the bound on its step's temporaries, as the planner counts them
    (:func:`held_by_optimizer`), which each candidate's memory holds (a replica its share,
    from ZeRO level 1);
    ``minibatch_size``: the samples a minibatch has, which a candidate's count must divide;
    with it and no ``microbatches`` each candidate is simulated at every count
    :func:`microbatch_counts` gives and keeps its fastest. ``machine``: the workers' own
    calibration (``nodes`` of them), whose costs around the layers (the runtime's overhead,
    sends, loss, data, updates: :func:`~dreampipe.machine.calibration.local_costs`) each
    candidate pays as a run's prediction does; without it, the profile's alone."""
    replicas = tuple(st.replicas for st in plan.stages)
    levels = plan.zero_levels(zero)
    counts = ((microbatches,) if microbatches else
              microbatch_counts(replicas, minibatch_size) if minibatch_size else
              (default_microbatches(replicas),))
    rounds = math.lcm(*replicas)
    found = []
    v = plan.virtual_stages
    if v > 1 and semantics is Semantics.ASYNC:
        raise ConfigError(f"semantics={semantics.value} with a plan of {v} stages per worker; "
                          "the schedules that run several (interleaved-1f1b, zbv, dualpipev) "
                          "are synchronous: use semantics=sync", "semantics")
    for kind in kinds or (SEVERAL if v > 1 else CANDIDATES[semantics]):
        tried = [_candidate(graph, plan, topology, semantics, kind, n, memory_bytes, levels,
                            replicas, optimizer, study, steps_agree, profile_share,
                            minibatch_size, machine, nodes)
                 for n in dict.fromkeys(_kind_count(kind, c, rounds, plan) for c in counts)]
        found.append(_fastest_count(tried))
    return _chosen(found, semantics, plan, memory_bytes)


def small_profile_batch(workers: int, minibatch_size: int, profiled: int) -> int:
    """The small batch to profile again at for a choice among microbatch counts on up to
    ``workers`` stages (:mod:`~dreampipe.profiling.fixed_costs`): the smallest microbatch
    :func:`microbatch_counts` prices, GPipe's 4 a stage; 0 where it is not below the
    ``profiled`` batch (nothing to add)."""
    small = max(1, minibatch_size // (GPIPE_MICROBATCHES_PER_STAGE * max(1, workers)))
    return small if small < profiled else 0


def microbatch_counts(replicas: Sequence[int], minibatch_size: int) -> tuple[int, ...]:
    """The microbatches per minibatch a candidate is simulated at, fewest first: every count
    that divides ``minibatch_size`` in whole rounds of the widest stage's replicas, up to
    :func:`~dreampipe.scheduling.microbatch_layout.default_microbatches` (GPipe's 4 a stage);
    none such: the nearest whole rounds that divide it (:func:`_dividing`). A count of 1
    may be the fastest once each microbatch's fixed costs are priced (the layers' own,
    timed at two batches, :mod:`~dreampipe.profiling.fixed_costs`, and the runtime's)."""
    widest, most = max(replicas), default_microbatches(replicas)
    found = tuple(d for d in range(widest, min(most, minibatch_size) + 1, widest)
                  if minibatch_size % d == 0)
    return found or (_dividing(most, widest, minibatch_size),)


def _fastest_count(tried: list[Candidate]) -> Candidate:
    """Of one schedule at several counts: the fastest that fits (a tie within rounding keeps
    the fewer microbatches), else the least memory, else the last count's reason not to
    run."""
    fit = [c for c in tried if c.fits and not c.why_not]
    if not fit:
        ran = [c for c in tried if not c.why_not]
        return min(ran, key=lambda c: c.peak_memory_bytes) if ran else tried[-1]
    best = fit[0]
    for c in fit[1:]:
        if c.to_target > best.to_target * (1 + _TIE):
            best = c
    return best


def _kind_count(kind: ScheduleKind, m: int, rounds: int, plan: Plan) -> int:
    """The microbatches ``kind`` runs a minibatch in where others run ``m`` (module doc)."""
    return {_S.PIPEDREAM: 1, _S.TWO_BW: -(-m // rounds) * rounds,
            _S.INTERLEAVED: -(-m // plan.workers_used) * plan.workers_used,
            _S.DUALPIPEV: max(m, plan.num_stages)}.get(kind, m)


def _candidate(graph: LayerGraph, plan: Plan, topology: Topology, semantics: Semantics,
               kind: ScheduleKind, per: int, memory_bytes: int | None, levels: tuple[int, ...],
               replicas: tuple[int, ...], optimizer: OptimizerTerms,
               study: Sequence[StudyRow], steps_agree: bool, profile_share: float,
               minibatch_size: int | None, machine: LocalCalibration | None, nodes: int
               ) -> Candidate:
    """``kind`` at ``per`` microbatches a minibatch, simulated, or why it is not tried."""
    v, split = plan.virtual_stages, plan.has_splits
    if kind.placement is Placement.V and v != 2:
        return Candidate(kind, per, 0.0, 0, False, why_not=(
            f"it runs 2 stages per worker, the plan {v}"))
    if split and kind in _NOT_ON_SPLITS:
        return Candidate(kind, per, 0.0, 0, False, why_not=(
            f"plan {plan.config} splits stages over workers, where the runtime runs "
            "1f1b-flush, gpipe and pipedream"))
    if not kind.synchronous and any(lv >= SHARDED_LEVEL and r > 1
                                    for lv, r in zip(levels, replicas, strict=True)):
        return Candidate(kind, per, 0.0, 0, False, why_not=(
            f"zero={max(levels)}: {ASYNC_REASON}"))
    if steps_agree and kind is _S.PIPEDREAM and len(set(replicas)) > 1:
        return Candidate(kind, per, 0.0, 0, False, why_not=(
            f"its stages, replicated {plan.config}, update at different rates and cannot "
            "agree on each update (clipping, a loss scale, skipping)"))
    if minibatch_size and minibatch_size % per:
        return Candidate(kind, per, 0.0, 0, False, why_not=(
            f"its {per} microbatches do not divide a minibatch of {minibatch_size}"))
    if per > MAX_2BW_MICROBATCHES:
        return Candidate(kind, per, 0.0, 0, False, why_not=(
            f"its {per} microbatches per minibatch (whole rounds of replicas "
            f"{plan.config}) are too many to simulate"))
    layout = MicrobatchLayout(kind=kind, microbatches=per)
    schedule = layout.build(replicas, _MINIBATCHES * (
        sum(replicas) if kind is _S.PIPEDREAM else 1), plan.in_flight, v, zero=levels,
        steps_agree=steps_agree)
    placed = plan.placed(kind.placement) if v > 1 else plan
    fraction = layout.microbatch_fraction / profile_share
    costs = (costs_from_profile(graph, placed, topology, fraction)
             if machine is None or v > 1 else  # interleaved: as its prediction prices it
             local_costs(graph, placed, fraction, measured_machine(graph, machine),
                         nodes=nodes))
    state = tuple(b / (r if lv >= 1 else 1) for b, lv, r in zip(
        held_by_optimizer(graph, placed, optimizer, costs.parameter_bytes), levels,
        schedule.replicas, strict=True))
    result = simulate_schedule(schedule, with_zero(
        dataclasses.replace(costs, steps_agree=steps_agree, state_bytes=state),
        schedule, levels), record_events=False)
    peak = max(result.peak_memory_bytes)
    weighed = epochs_factor(kind, plan.num_stages, study) if (
        semantics is Semantics.ANY) else None
    # the simulator counts profiled batches: a minibatch is 1 / profile_share of them
    return Candidate(kind, per, result.throughput_minibatches_per_s * profile_share, peak,
                     memory_bytes is None or peak <= memory_bytes,
                     epochs=None if weighed is None else weighed.factor,
                     study="" if weighed is None else weighed.why)


def _chosen(found: list[Candidate], semantics: Semantics, plan: Plan,
            memory_bytes: int | None) -> ScheduleChoice:
    """The fastest candidate that fits (ties: the earlier), or an error naming why none."""
    fitting = [c for c in found if c.fits]
    runnable = [c for c in found if not c.why_not]
    if not runnable:
        raise ConfigError(
            f"no {semantics.value} schedule can run plan {plan.config}: "
            + "; ".join(f"{c.kind.value}: {c.why_not}" for c in found)
            + "; choose another: an asynchronous schedule (semantics=async or "
            "schedule=pipedream), fewer microbatches, or a batch planned for the synchronous "
            "objective (dreampipe plan --global-batch B)", "semantics", "schedule")
    if not fitting:
        least = min(runnable, key=lambda c: c.peak_memory_bytes)
        raise ConfigError(
            f"memory_bytes={memory_bytes}: no {semantics.value} schedule of plan "
            f"{plan.config} fits {format_bytes(memory_bytes or 0)} per worker (the least, "
            f"{least.kind.value}, needs {format_bytes(least.peak_memory_bytes)}); give more "
            "memory, or plan with the limit so that the stages fit", "memory_bytes")
    best = fitting[0]
    for c in fitting[1:]:  # a tie within rounding keeps the earlier candidate
        if c.to_target > best.to_target * (1 + _TIE):
            best = c
    return ScheduleChoice(best.kind, best.microbatches, tuple(found), memory_bytes)

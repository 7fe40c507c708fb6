"""What each stage's workers are predicted to hold at most: :func:`predict_memory`.

Weights, their stashed versions, gradients, optimizer state (as the user's optimizer
holds it, 32-bit masters for 16-bit weights), ZeRO's shards, and the activations of the
microbatches in flight, walked as the schedule runs them; the figure a rank's
:class:`~dreampipe.runtime.memory_meter.Meter` measures (docs/design.md §5.4,
docs/memory.md). :func:`check_memory` holds a plan to a memory limit.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

from dreampipe.errors import ConfigError
from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.memory_terms import SENDS_KEPT, OptimizerTerms
from dreampipe.planning.plan import Plan, Stage
from dreampipe.planning.state_bytes import zero_bytes
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import format_bytes
from dreampipe.runtime.buckets import BUCKET_CAP_MB, in_place
from dreampipe.runtime.memory_split import split_peak, with_step
from dreampipe.runtime.memory_walks import (
    by_stage,
    gradients_later,
    most_in_flight,
    waiting_bytes,
    walk_saved,
)
from dreampipe.runtime.optimizer_step import NO_STEP_BYTES, StepBytes, stage_step_bytes
from dreampipe.runtime.precision import Precision
from dreampipe.runtime.runner_options import OptimizerKind
from dreampipe.runtime.staleness import Hyper, prediction_delays
from dreampipe.scheduling.actions import Action, ActionKind, Schedule, ScheduleKind
from dreampipe.scheduling.unshard import SHARDED_LEVEL, pairs_per_use
from dreampipe.scheduling.weight_versions import peak_versions, release_kind

__all__ = ["PREDICTION_COPIES", "TrainingChoices", "check_memory", "counted_twice",
           "optimizer_copies", "planner_terms", "predict_memory"]

_log = logging.getLogger(__name__)
_SENDS = (ActionKind.SEND_F, ActionKind.SEND_B)


@dataclass(frozen=True, kw_only=True)
class TrainingChoices:
    """What memory depends on among a run's options: the optimizer's state, the
    weight versions stashing, vertical sync and staleness compensation keep, and the
    number formats (16-bit weights add 32-bit master weights), and the blocks each stage
    recomputes (its first ``recompute_blocks`` layers of class ``block``), and the ZeRO
    level replicated stages shard at."""

    optimizer: OptimizerKind
    momentum: float
    stash: bool
    vertical_sync: bool
    compensate: bool
    precision: Precision = Precision.FP32
    recompute_blocks: int = 0
    block: str | None = None  # the block class's name (the profile's layer description)
    zero: int = 0  # the run's ZeRO level (a plan's stage may set its own)
    state_copies: float | None = None  # the optimizer's, counted (None: from its kind)
    step_bytes: StepBytes = NO_STEP_BYTES  # its step's temporaries (:mod:`.optimizer_step`)

    @property
    def hyper(self) -> Hyper:
        """The settings staleness compensation reads (the learning rate aside)."""
        return Hyper(0.0, self.momentum, adaptive=self.optimizer is OptimizerKind.ADAM)


#: Weight prediction's extra copies of a delayed stage's weights (:mod:`.versions`): the
#: last update's change, and the live weights, which no microbatch in flight shares any more.
PREDICTION_COPIES = 2


def optimizer_copies(opts: TrainingChoices) -> float:
    """The optimizer's state in copies of the weights as the run holds them: SGD 0, with
    momentum 1, Adam 2; with 16-bit weights, those and the master weights, each 32-bit
    (twice a 16-bit copy)."""
    state = _state_copies(opts)
    return (state + 1) * 2 if opts.precision.master_weights else state


def planner_terms(opts: TrainingChoices) -> OptimizerTerms:
    """What the planner counts of the run's optimizer beside a stage's weights
    (:class:`~dreampipe.planning.memory_terms.OptimizerTerms`): its state as
    :func:`optimizer_copies` counts it, and a bound on its step's temporaries
    (:func:`~.optimizer_step.stage_step_bytes`: the second largest parameter taken as large
    as the largest, every parameter at most its layer)."""
    step, scale = opts.step_bytes, 2.0 if opts.precision.master_weights else 1.0
    return OptimizerTerms(state_copies=float(optimizer_copies(opts)),
                          per_largest=(step.largest + step.second) * scale,
                          per_byte=step.total * scale
                          + (scale if opts.precision.master_weights else 0.0))


def _state_copies(opts: TrainingChoices) -> float:
    """The optimizer's 32-bit state tensors a parameter: SGD 0, with momentum 1, Adam 2
    (or as counted on the optimizer a run holds)."""
    if opts.state_copies is not None:
        return opts.state_copies
    return 2 if opts.optimizer is OptimizerKind.ADAM else 1 if opts.momentum else 0


def _zero_states(st: Stage, level: int, weights: int, opts: TrainingChoices, *,
                 whole: bool = False) -> int:
    """What stage ``st``'s ZeRO ``level`` shards away between computations: the
    optimizer's state and master weights, from level 2 the gradients, at 3 the weights
    unless ``whole`` (gathered for the update, not per use)
    (:func:`~dreampipe.planning.state_bytes.zero_bytes`)."""
    if level == 0 or st.replicas == 1:
        return 0

    def held(at: int) -> float:
        return zero_bytes(at, st.replicas, weights, optimizer_copies=_state_copies(opts),
                          master_weights=opts.precision.master_weights).total

    gathered = weights if whole and level >= SHARDED_LEVEL else 0
    return round(held(0) - held(level)) - gathered


def _zero_saved(st: Stage, level: int, weights: int, largest: int, opts: TrainingChoices,
                whole: bool) -> int:
    """What stage ``st``'s ZeRO ``level`` saves each replica at its peak
    (:func:`~dreampipe.planning.state_bytes.zero_bytes`): the optimizer's state and master
    weights sharded; from level 2 the gradients too, but for a microbatch's gradient
    whole in its buckets (:mod:`.zero_buckets`): all of it where one bucket of
    ``BUCKET_CAP_MB`` holds it (reduce-scattered as the backward's last gradient is
    made, once that microbatch's tensors are freed), else two buckets whole at a time,
    one on its way with its summed chunk and one filling (a bucket of ``BUCKET_CAP_MB``,
    or of one larger parameter, a layer's largest taken as half its bytes, at most the
    stage's largest layer, ``largest``); and one module's transient during the backward's
    peak rather than after it: the fresh gradient of its parameter going into its bucket,
    or at level 3 its weights gathered per use (half the largest layer's). At level 3
    beside the chunks, where ``whole`` (not gathered per use), the weights gathered for
    the update's computations, or a recomputing stage's in its backward (all of them;
    :mod:`.zero_params`)."""
    if level == 0 or st.replicas == 1:
        return 0
    saved: float = _zero_states(st, level, weights, opts, whole=whole)
    if level >= 2:
        bucket = min(weights, largest, max(BUCKET_CAP_MB * 1e6, largest / 2))
        in_buckets = (weights if weights <= BUCKET_CAP_MB * 1e6
                      else min(weights, 2 * bucket) + bucket / st.replicas)
        saved -= in_buckets + largest / 2
    return round(saved)


def predict_memory(graph: LayerGraph, plan: Plan, schedule: Schedule, opts: TrainingChoices,
                   *, library: bool = True) -> tuple[int, ...]:
    """Bytes each stage's workers will add to their baseline when running ``schedule``;
    without ``library``, their tensors' only (what a :class:`~.memory_meter.Meter`
    measures: not the compute library's kernel caches,
    :attr:`~dreampipe.profiling.graph.Layer.library_bytes`).

    :meth:`RangeCosts.memory` of the stage, with what the schedule's busiest rank of the stage
    reaches: the microbatches in flight, the weight versions they pin (one per microbatch in flight
    under PipeDream with stashing, plus the ``s`` updates stage ``s`` may be ahead with vertical
    sync and the live weights beside them after the first stage; else those its
    microbatches run on beside the live ones, two under 2bw,
    :mod:`~dreampipe.scheduling.weight_versions`) and the sent tensors it keeps (all of a
    run's sends up to ``SENDS_KEPT``), and
    with staleness compensation :data:`PREDICTION_COPIES` more on a stage that predicts its weights
    (Adam's); a recomputing stage keeps its microbatches' inputs only. A stage split over ``t``
    workers holds its share of each layer
    (:func:`~dreampipe.planning.operator_search.split_memory`), whatever the other stages' widths,
    plus, when an update spans several microbatches, the transient gradient of its largest layer's
    share. A replicated stage also holds its gradients' all-reduce buckets (:mod:`.buckets`: flat
    copies of its small gradients, made as the backward that ends a round ends, alive until the
    round's ``ALLREDUCE``; :mod:`.memory_walks`). Under a split backward a
    microbatch stays in flight until its ``W``, and after the first stage (whose ``B`` leaves
    the whole backward to ``W``) each waiting for it holds what ``B`` recorded, when that
    raises the peak (:mod:`.memory_walks`). ``graph`` is profiled in the run's number
    formats at the schedule's microbatch size.
    """
    if not library:
        graph = graph.without_library()
    costs = RangeCosts.of(graph)
    flight, sends = most_in_flight(schedule, plan.num_stages), [0] * plan.num_stages
    ranks: dict[int, list[tuple[Action, ...]]] = {}
    for stage, actions in by_stage(schedule):
        ranks.setdefault(stage, []).append(actions)
        sends[stage] = max(sends[stage], sum(a.kind in _SENDS for a in actions))
    stashing = opts.stash and schedule.kind is ScheduleKind.PIPEDREAM
    predicted = prediction_delays(schedule, opts.hyper, vertical_sync=opts.vertical_sync,
                                  compensate=opts.compensate, stash=opts.stash)
    held = [max((peak_versions(acts, schedule.kind, schedule.microbatches_per_update)
                 for acts in ranks.get(s, ())), default=1) for s in range(plan.num_stages)]
    out = []
    for s, st in enumerate(plan.stages):
        versions = flight[s] + _vertical_versions(s, opts) if stashing else held[s]
        versions += PREDICTION_COPIES if predicted[s] else 0
        if st.tensor_parallel > 1:
            out.append(split_peak(
                graph, st, versions=versions, in_flight=flight[s],
                optimizer_copies=optimizer_copies(opts), stash=opts.stash,
                synchronous=schedule.kind.synchronous,
                microbatches_per_update=schedule.microbatches_per_update,
                step=opts.step_bytes, master_weights=opts.precision.master_weights))
            continue
        sizes = [layer.parameter_bytes for layer in graph.layers[st.first : st.last + 1]]
        sizes.append(graph.reused_bytes(st.first, st.last))  # its copies of shared weights
        weights, level = sum(sizes), plan.zero_levels(opts.zero)[s]
        walked = opts.stash and not st.recompute
        # ZeRO-3 gathers the weights whole for the update unless per use without recompute
        whole = not (pairs_per_use(schedule, s) and not st.recompute)
        gradients, buckets = _gradient_terms(graph, st, weights, level)
        saved, each = (walk_saved(graph, st, s, _recomputed(graph, st, opts), flight[s])
                       if walked else (0, 0))
        holding = functools.partial(  # the formula's bytes with so many in flight
            costs.memory, st.first, st.last, versions, optimizer_copies=optimizer_copies(opts),
            stash=opts.stash, sends_kept=min(sends[s], SENDS_KEPT), recompute=st.recompute)
        working = int(costs.backward_working[st.first, st.last])
        at_once = holding(flight[s])
        beside = _working(costs, st, flight[s], saved, each) if walked else 0
        main = (at_once - saved + (0 if walked else buckets)
                - _zero_saved(st, level, weights, max(sizes, default=0), opts, whole)
                + (max(waiting_bytes(acts, graph, st, beside, each if walked else None)
                       for acts in ranks[s])
                   if s > 0 else 0)
                - (min(gradients_later(acts, each + _received(costs, st), gradients,
                                        buckets - beside, s)
                       for acts in ranks[s]) if walked else 0)
                + max(0, _cast_gradient(_parameters(graph, st, autocast=True), opts.precision,
                                        schedule.round_microbatches(s))
                      - working))
        # the step: weights, gradients, state and the microbatches still in flight (none
        # after a flush, all but the one just done when asynchronous), no backward's working
        # set; with its temporaries, the larger of the two peaks after a flush (the
        # all-reduce's buckets gone), beside the other's activations when asynchronous
        stepping = holding(0 if schedule.kind.synchronous else max(flight[s] - 1, 0)) - working
        step = round(stage_step_bytes(opts.step_bytes, _parameters(graph, st),
                                      master_weights=opts.precision.master_weights,
                                      shards=st.replicas if level >= 1 else 1))
        zero_states = (_zero_states(st, level, weights, opts, whole=whole)
                       if schedule.kind.synchronous else 0)
        out.append(with_step(main, at_once - saved, stepping, step - zero_states,
                             schedule.kind.synchronous))
    return tuple(out)


def counted_twice(graph: LayerGraph, plan: Plan, schedule: Schedule, opts: TrainingChoices,
                  *, library: bool = True) -> tuple[int, ...]:
    """Per rank, what the sum of its stages' :func:`predict_memory` counts that the rank
    never holds at once (0 for a rank of one stage): it runs one backward at a time, so
    it holds one stage's working set (as its prediction counts it, walked), the largest;
    and its stages' microbatches in flight peak together only as its actions hold them,
    walked along them, less what each stage's prediction took off already as its
    gradients are not made yet at its own peak (:func:`.gradients_later`); and it steps
    its stages one at a time, so it holds one stage's step temporaries, the most that
    raise a stage's peak (docs/memory.md)."""
    if not library:
        graph = graph.without_library()
    several = any(len({a.stage for a in actions}) > 1 for actions in schedule.actions)
    steps = [with_step - without for with_step, without in zip(
        predict_memory(graph, plan, schedule, opts, library=library),
        predict_memory(graph, plan, schedule, replace(opts, step_bytes=NO_STEP_BYTES),
                       library=library), strict=True)] if several else []
    costs, flight = RangeCosts.of(graph), most_in_flight(schedule, plan.num_stages)
    out = []
    for actions in schedule.actions:
        mine = sorted({a.stage for a in actions})
        if len(mine) < 2 or any(plan.stages[s].tensor_parallel > 1 for s in mine):
            out.append(0)
            continue
        each, work, later = {}, {}, 0
        for s in mine:
            st = plan.stages[s]
            kept = float(costs.kept[st.first, st.last])
            walked = opts.stash and not st.recompute
            saved, own = walk_saved(graph, st, s, _recomputed(graph, st, opts), 1) \
                if walked else (0, 0)
            each[s] = _received(costs, st) + own
            beside = _working(costs, st, 1, saved, own)  # walked, as predict_memory's
            work[s] = float(beside) if walked else float(
                costs.backward_working[st.first, st.last]) + _received(costs, st) + kept
            if walked:  # as predict_memory takes it off the stage's peak
                weights = (sum(x.parameter_bytes for x in graph.layers[st.first : st.last + 1])
                           + graph.reused_bytes(st.first, st.last))
                gradients, buckets = _gradient_terms(graph, st, weights,
                                                      plan.zero_levels(opts.zero)[s])
                later += gradients_later(tuple(a for a in actions if a.stage == s),
                                         round(each[s]), gradients, buckets - beside, s)
        release, held, joint = release_kind(actions), dict.fromkeys(mine, 0), 0.0
        for a in actions:
            held[a.stage] += a.kind in (ActionKind.FORWARD, ActionKind.OVERLAP)
            if a.kind is release:
                held[a.stage] -= 1
            elif a.kind is ActionKind.OVERLAP and a.backward_stage in held:
                held[a.backward_stage] -= release is ActionKind.BACKWARD
            joint = max(joint, sum(held[s] * each[s] for s in mine))
        apart = sum(flight[s] * each[s] for s in mine)
        out.append(round(max(0.0, apart - joint - later) + sum(work.values()) - max(work.values())
                         + sum(steps[s] for s in mine) - max(steps[s] for s in mine)))
    return tuple(out)


def _recomputed(graph: LayerGraph, st: Stage, opts: TrainingChoices) -> list[int]:
    """The stage's first ``recompute_blocks`` blocks (layers of the block class)."""
    if not opts.recompute_blocks or opts.block is None:
        return []
    return [i for i in range(st.first, st.last + 1)
            if graph.layers[i].description == opts.block][: opts.recompute_blocks]


def _gradient_terms(graph: LayerGraph, st: Stage, weights: int, level: int
                    ) -> tuple[int, int]:
    """The gradients made in an update's first backward and freed at its step (from
    ZeRO-2 on, this replica's chunks: the buckets come and go in every backward), and a
    replicated stage's all-reduce buckets (:mod:`.buckets`: flat copies of the gradients
    not :func:`.in_place`; a layer's largest parameter, where measured, is its one such
    gradient, and its others are counted as packed, a bound)."""
    if st.replicas == 1 or level >= 2:
        return (weights // st.replicas if level >= 2 else weights), 0
    packed = graph.reused_bytes(st.first, st.last)  # tied copies: counted as packed
    for x in graph.layers[st.first : st.last + 1]:
        big = x.largest_parameter_bytes is not None and in_place(x.largest_parameter)
        packed += x.parameter_bytes - (x.largest_parameter if big else 0)
    return weights, min(weights, packed)


def _received(costs: RangeCosts, st: Stage) -> int:
    """What a microbatch in flight holds of stage ``st``'s input: the input, and the copy
    its forward runs on where its first layer writes it (:attr:`RangeCosts.copies`)."""
    return round(float(costs.cut_bytes[st.first] + costs.copies[st.first]))


def _working(costs: RangeCosts, st: Stage, in_flight: int, saved: int, each: int) -> int:
    """What the formula's peak holds beside the kept tensors of its microbatches in flight
    (``each`` bytes each, walked: ``saved``): the backward's working set, gone once a
    backward ends."""
    return round(float(costs.kept[st.first, st.last]) * in_flight
                 + float(costs.backward_working[st.first, st.last]) - saved) - each * in_flight


def _vertical_versions(s: int, opts: TrainingChoices) -> int:
    """The versions vertical sync keeps on stage ``s`` beside one per microbatch in flight:
    the ``s`` updates the stage may be ahead of the input stage's version, and, after the
    first stage, the live weights beside them (the version a microbatch will run on is
    kept, :meth:`~.versions.WeightVersions.retire`, so an update moves the live weights to
    a copy of their own)."""
    return (s + 1 if s > 0 else 0) if opts.vertical_sync else 0


def _parameters(graph: LayerGraph, st: Stage, *, autocast: bool = False) -> list[int]:
    """Parameter sizes of stage ``st`` as far as its profile knows them: each layer's
    largest, and the rest of the layer as one more (a bound on its second largest), and
    each copy it holds of a weight an earlier stage counts (a tied head); with
    ``autocast``, those of layers autocast computes in 16 bits (not an ``Embedding``'s)."""
    layers = [x for x in graph.layers[st.first : st.last + 1]
              if not (autocast and x.description.startswith("Embedding"))]
    copies = {(f, k): size for x in layers for f, k, size in x.reused if f < st.first}
    return [b for x in layers for b in (x.largest_parameter,
                                         x.parameter_bytes - x.largest_parameter) if b
            ] + [b for b in copies.values() if b]


def _cast_gradient(sizes: list[int], precision: Precision, microbatches: int) -> int:
    """Under autocast a weight's gradient is made in the compute dtype and cast to its
    32-bit parameter's before it joins the update's sum: the largest parameter's 16-bit
    gradient beside the sum it becomes, where an update has one microbatch; its 32-bit
    copy beside the sum, where it has more (docs/memory.md). It is made in the backward
    of its layer, whose working set the stage counts already: the larger counts."""
    cast = precision.autocast
    if cast is None or not sizes:
        return 0
    if microbatches > 1:
        return max(sizes)
    return max(sizes) * cast.itemsize // precision.param_dtype.itemsize


def check_memory(plan: Plan, predicted: tuple[int, ...], limit: int | None) -> None:
    """A ConfigError naming the first stage whose ``predicted`` bytes exceed ``limit``."""
    if limit is None:
        return
    for s, (st, need) in enumerate(zip(plan.stages, predicted, strict=True)):
        if need > limit:
            raise ConfigError(
                f"memory_bytes={limit} ({format_bytes(limit)} per worker) is too little: stage "
                f"{s} (layers {st.first}..{st.last}) needs about {format_bytes(need)} for its "
                "weights, their stashed versions, gradients, optimizer state and the "
                "activations of its minibatches in flight; raise the limit, cut the model "
                "into more stages, or train on smaller minibatches", "memory_bytes",
            )

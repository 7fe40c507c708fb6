"""A training job on the workers at hand: its plan and its predicted throughput.

``dreampipe train``, ``demo`` and ``bench`` all do the same three things
before they run anything: profile the model on this machine (one thread, as
each worker runs), plan it for the workers they have (or evaluate a
partition the user forced), and ask the simulator what throughput that plan
should reach, so the run can print predicted beside measured.

This machine is described as a flat topology: ``N`` workers, all joined by
gloo over the loopback interface at :data:`LOCAL_BANDWIDTH`. That figure is
what a 1 MB ``send``/``recv`` ping-pong between two local gloo processes
sustained on the project's 2-core machine (0.5 to 4 GB/s, noisy); for the
models dreampipe trains on a CPU, communication is a small part of the
time, so the figure matters little.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from dreampipe.errors import PlanError
from dreampipe.models import ModelSpec, get_model
from dreampipe.planning.plan import Plan, stages_from_config
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runtime.config import units_per_update
from dreampipe.scheduling.actions import ScheduleKind

if TYPE_CHECKING:
    from dreampipe.simulation.simulator import SimCosts

__all__ = [
    "LOCAL_BANDWIDTH",
    "LOCAL_BATCH_LOAD_S",
    "LOCAL_LOSS_S",
    "LOCAL_SEND_COPY_BANDWIDTH",
    "LOCAL_SEND_OVERHEAD_S",
    "LOCAL_STAGE_FORWARD_S",
    "choose_plan",
    "forced_partition",
    "local_costs",
    "local_topology",
    "model_spec",
    "parse_stage_bounds",
    "predict_samples_per_s",
    "profile_model",
    "steps_for_epochs",
    "unit_size",
]

log = logging.getLogger(__name__)

#: Bandwidth between two worker processes on one machine (gloo over loopback).
LOCAL_BANDWIDTH = "1GB/s"
#: Host time a CPU worker spends posting one gloo send: a fixed part plus a copy.
#: Read off the runtime's measured SEND events for the bench's mlp on the
#: project's 2-core machine (0.24 ms for 128 KiB, 0.39 ms for 512 KiB).
LOCAL_SEND_OVERHEAD_S = 0.19e-3
LOCAL_SEND_COPY_BANDWIDTH = 2.6e9
#: Host time of a runtime forward that the layer profile does not time, per
#: unit and stage. Each runs right after the GEMMs of the previous backward
#: have left the caches cold, where a small tensor op costs 30-60 us instead
#: of 1-4 us, so they were measured that way (12 1024x1024 GEMMs before each
#: call) on the project's 2-core machine. ``StageModule.forward`` (the
#: stashed version put in by ``functional_call``, the bookkeeping) took
#: 0.31 ms against 0.19 ms for calling the same 4 mlp layers (width 16, so
#: that nothing but the overhead is left) directly: 0.1 ms.
LOCAL_STAGE_FORWARD_S = 0.10e-3
#: Loading a unit's samples (input stage) or labels (last stage), cold: 0.07 ms.
LOCAL_BATCH_LOAD_S = 0.07e-3
#: The last stage's loss, which the profile leaves out (it times layers):
#: 0.06 ms for the mlp's 32 x 10 cross-entropy, timed inside the runtime's forward.
LOCAL_LOSS_S = 0.06e-3


def local_topology(workers: int) -> Topology:
    """This machine as ``workers`` workers on one level at :data:`LOCAL_BANDWIDTH`."""
    if workers < 1:
        raise PlanError(f"--workers {workers}: use at least 1 worker")
    return Topology.parse(str(workers), bandwidths=[LOCAL_BANDWIDTH])


def local_costs(graph: LayerGraph, plan: Plan, unit_fraction: float) -> SimCosts:
    """Simulator costs of ``plan`` on this machine's workers.

    The profile's layer times plus the host time the runtime spends around
    them: posting each send (:data:`LOCAL_SEND_OVERHEAD_S`), and in each
    forward the stage's own overhead, loading the unit's data and the loss.
    """
    from dreampipe.simulation.simulator import costs_from_profile

    costs = costs_from_profile(graph, plan, local_topology(plan.workers_used), unit_fraction)
    forward = [f + LOCAL_STAGE_FORWARD_S for f in costs.forward_s]
    forward[0] += LOCAL_BATCH_LOAD_S
    if len(forward) > 1:
        forward[-1] += LOCAL_BATCH_LOAD_S
    forward[-1] += LOCAL_LOSS_S
    return dataclasses.replace(
        costs, forward_s=tuple(forward), send_overhead_s=LOCAL_SEND_OVERHEAD_S,
        send_copy_bandwidth=LOCAL_SEND_COPY_BANDWIDTH,
    )


def unit_size(kind: ScheduleKind, minibatch_size: int, microbatches: int, workers: int = 1) -> int:
    """Samples in one scheduled unit (see :func:`~dreampipe.runtime.config.units_per_update`)."""
    per = units_per_update(kind, microbatches, workers)
    if minibatch_size % per:
        raise PlanError(
            f"--batch-size {minibatch_size} does not split into {per} equal units "
            f"({kind.value}, {microbatches} microbatches, {workers} workers); use a multiple "
            f"of {per}"
        )
    return minibatch_size // per


def profile_model(spec: ModelSpec, batch_size: int, *, repeats: int = 5) -> LayerGraph:
    """Profile ``spec`` at ``batch_size`` with one thread, as each worker runs."""
    from dreampipe.profiling.profiler import profile_spec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return profile_spec(spec, batch_size=batch_size, repeats=repeats)
    finally:
        torch.set_num_threads(threads)


def parse_stage_bounds(text: str, num_layers: int) -> list[int]:
    """``"0,4"`` (the first layer of each stage) into ``[0, 4]``, checked against the model."""
    try:
        bounds = [int(x) for x in text.split(",")]
    except ValueError:
        raise PlanError(
            f"--stages {text!r}: list the first layer of each stage, e.g. 0,4"
        ) from None
    if bounds[0] != 0 or any(b <= a for a, b in itertools.pairwise(bounds)):
        raise PlanError(f"--stages {text!r} must start at 0 and increase, e.g. 0,4")
    if bounds[-1] >= num_layers:
        raise PlanError(
            f"--stages {text!r} starts a stage at layer {bounds[-1]} but the model has "
            f"{num_layers} layers (0..{num_layers - 1})"
        )
    return bounds


def forced_partition(
    num_layers: int, workers: int, config: str | None, stages: str | None
) -> tuple[list[int], list[int]] | None:
    """``(bounds, replicas)`` forced by ``--config``/``--stages``, or None to plan.

    ``config`` (``"2-1"``) and ``stages`` (``"0,4"``) give one replica count
    and one first layer per stage; ``stages`` alone means one worker per
    stage, ``config`` alone a single stage.
    """
    if config is None and stages is None:
        return None
    bounds = parse_stage_bounds(stages, num_layers) if stages is not None else [0]
    replicas = stages_from_config(config, len(bounds)) if config else [1] * len(bounds)
    if len(replicas) != len(bounds):
        raise PlanError(
            f"--config {config!r} has {len(replicas)} stages but --stages "
            f"{stages or '0'!r} starts {len(bounds)}; give one first layer per stage"
        )
    if sum(replicas) != workers:
        raise PlanError(
            f"--config {config or 'straight'!r} needs {sum(replicas)} workers, not {workers}; "
            f"use --workers {sum(replicas)}"
        )
    return bounds, replicas


def choose_plan(
    graph: LayerGraph,
    workers: int,
    *,
    config: str | None = None,
    stages: str | None = None,
    allow_fewer_workers: bool = True,
) -> Plan:
    """The planner's best plan for ``workers`` local workers, or the forced partition costed."""
    from dreampipe.planning import planner

    topology = local_topology(workers)
    forced = forced_partition(len(graph.layers), workers, config, stages)
    if forced is None:
        return planner.plan_pipeline(graph, topology, allow_fewer_workers=allow_fewer_workers)
    return planner.evaluate_plan(graph, topology, *forced)


def predict_samples_per_s(
    graph: LayerGraph,
    plan: Plan,
    kind: ScheduleKind,
    *,
    minibatch_size: int,
    microbatches: int,
    steps: int,
) -> float:
    """Samples/s the simulator predicts for ``steps`` updates of ``plan`` under ``kind``.

    ``graph`` must be profiled at :func:`unit_size` samples, so each
    scheduled unit costs what the profile measured.
    """
    from dreampipe.scheduling.build import build_schedule
    from dreampipe.simulation.simulator import simulate_schedule

    unit = unit_size(kind, minibatch_size, microbatches, plan.workers_used)
    per_update = units_per_update(kind, microbatches, plan.workers_used)
    replicas = [st.replicas for st in plan.stages]
    schedule = build_schedule(replicas, kind, steps * per_update, units_per_update=per_update)
    fraction = unit / graph.batch_size if graph.batch_size else 1.0
    result = simulate_schedule(schedule, local_costs(graph, plan, fraction))
    events = result.events
    span = max(e.end_s for e in events) - min(e.start_s for e in events) if events else 0.0
    if span <= 0:
        return 0.0
    return steps * minibatch_size / span


def steps_for_epochs(epochs: float, train_samples: int, minibatch_size: int) -> int:
    """Weight updates (PipeDream: minibatches) that cover ``epochs`` passes over the data."""
    if epochs <= 0:
        raise PlanError(f"--epochs {epochs}: use a positive number of epochs")
    return max(1, math.ceil(epochs * train_samples / minibatch_size))


def model_spec(name: str, model_kwargs: Sequence[tuple[str, Any]] = ()) -> ModelSpec:
    """The zoo model ``name`` sized by ``model_kwargs``; a bad size is a :class:`PlanError`.

    The layers are built once on the ``meta`` device (no memory, no compute),
    so a size of the wrong type or sign fails here, not inside profiling.
    """
    try:
        spec = get_model(name, **dict(model_kwargs))
        with torch.device("meta"):
            spec.build(seed=0)
    except (TypeError, ValueError, RuntimeError) as exc:
        if isinstance(exc, PlanError):
            raise
        raise PlanError(
            f"model {name!r} with {dict(model_kwargs)}: {exc}; give --model-arg values the "
            f"zoo function {name}() accepts"
        ) from None
    return spec


"""This machine as the planner and the simulator see it: topology, calibration, costs.

Local workers are ``N`` processes on one level, all joined by gloo over the
loopback interface (or NCCL between GPUs). A torchrun job over several nodes
adds an outer level, the nodes as servers::

    nodes x workers per node      inner: machine.bandwidth, latency_s
    2     x 2                     outer: machine.outer_bandwidth, outer_latency_s

both measured on the machine (:mod:`~dreampipe.machine.machine_file`, written
by ``dreampipe calibrate``, or measured at start-up by
:mod:`~dreampipe.machine.measure`). The layer profile times only the layers;
the runtime spends host time around them too. :class:`LocalCalibration`
holds both kinds of figure so that a prediction for this machine can add
what the profile leaves out; :func:`measured_machine` puts in the rates
measured with a profile (:mod:`~dreampipe.machine.rates`), since the host's
drift moves them too.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dreampipe.errors import ConfigError
from dreampipe.planning.plan import Plan
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph

if TYPE_CHECKING:
    from dreampipe.simulation.simulator import SimCosts

__all__ = ["LocalCalibration", "corun_crowd", "corun_twins", "local_costs",
           "local_topology", "measured_machine", "measured_topology", "split_layer_seconds"]


@dataclass(frozen=True, kw_only=True)
class LocalCalibration:
    """Measured figures of one machine's workers; seconds and bytes/s.

    ``bandwidth``, ``step_bandwidth`` and ``stash_copy_bandwidth`` give way to
    the rates measured with a profile where it has them (:func:`measured_machine`).
    """

    #: Between two workers of one node: the bandwidth at which the planner's
    #: ring term gives the time the runtime's bucketed gradient all-reduce took
    #: (:mod:`~dreampipe.machine.rates`), and the per-message latency of a
    #: ping-pong between them (:mod:`~dreampipe.machine.measure`).
    bandwidth: str
    latency_s: float = 0.0
    #: The same between nodes (one worker on each); None where no job over
    #: several nodes was measured.
    outer_bandwidth: str | None = None
    outer_latency_s: float = 0.0
    #: Parameter bytes one SGD step updates per second on one worker (the
    #: runtime's ``STEP``, caches evicted between steps as a run's compute does).
    step_bandwidth: float
    #: How much slower a worker's forward and backward run beside another
    #: busy worker than alone, as the layer profile is taken: the cores share
    #: caches and memory bandwidth. Only for a profile taken alone:
    #: ``dreampipe train`` profiles beside busy twins instead.
    corun_slowdown: float
    #: Parameter bytes per second a ``STEP`` copies when a microbatch in flight still
    #: needs the version it replaces (weight stashing's copy-on-write: stage 0
    #: of a 2-stage PipeDream pipeline copies at every step, stage 1 never).
    stash_copy_bandwidth: float
    #: Host time to post one send: a fixed part plus a copy at
    #: ``send_copy_bandwidth`` (the ping-pong's send calls, fitted).
    send_overhead_s: float
    send_copy_bandwidth: float
    #: A runtime forward's own host time per microbatch and stage, which the layer
    #: profile does not time (``StageModule.forward``'s bookkeeping). Used
    #: only for a profile without the factors that
    #: :mod:`~dreampipe.runplan.runtime_overhead` measures with every local profile.
    stage_forward_s: float
    #: Loading a microbatch's samples (input stage) or labels (last stage), cold.
    batch_load_s: float
    #: The last stage's loss, which the profile leaves out (it times layers).
    #: Used only for a profile without the loss's own times, which
    #: :mod:`~dreampipe.runplan.runtime_overhead` measures with every local profile.
    loss_s: float
    #: Whether gradient all-reduces overlap the backward. Not with gloo: it
    #: moves and sums the bytes on the cores that compute, so an all-reduce
    #: started during the backward slows it as much as it hides. NCCL moves
    #: them on the GPUs' copy engines, beside the compute.
    overlap: bool = False
    #: What one layer of a tensor-split stage spends beyond its compute share and its
    #: collectives, per forward and per backward: DTensor's host work on each operator
    #: (:mod:`~dreampipe.machine.split_layers`). 0 for a machine file measured before
    #: dreampipe measured it.
    split_layer_forward_s: float = 0.0
    split_layer_backward_s: float = 0.0
    #: Cores the workers share. More workers than cores take turns on them
    #: (a gloo wait sleeps: it takes no core), at the pace measured with the
    #: profile (``profile_beside``'s crowd), else evenly.
    cores: int = dataclasses.field(default_factory=lambda: len(os.sched_getaffinity(0)))




def corun_twins(workers: int, machine: LocalCalibration) -> int:
    """Busy twins to profile beside for a run of ``workers`` local workers: each worker
    computes beside the others, as many at once as there are cores."""
    return max(0, min(workers, machine.cores) - 1)


def _corun_factor(graph: LayerGraph, workers: int, machine: LocalCalibration) -> float:
    """How much slower than ``graph`` says a worker computes beside the others.

    No slowdown for one worker, or for a profile taken beside as many busy twins
    (``meta["twins"]``, :func:`dreampipe.runplan.profile_beside.profile_beside`) as
    compute beside each worker; else the machine's calibrated figure.
    """
    if workers <= 1 or int(graph.meta.get("twins", 0)) >= corun_twins(workers, machine):
        return 1.0
    return machine.corun_slowdown


def corun_crowd(workers: int, machine: LocalCalibration) -> int:
    """Workers beyond the cores: they wait while the others profile, then all train
    at once to measure the pace the cores' sharing gives
    (:func:`~dreampipe.runplan.profile_beside.profile_beside`)."""
    return max(0, workers - machine.cores)


def _share(graph: LayerGraph, workers: int, machine: LocalCalibration) -> float:
    """How much longer a worker takes when ``workers`` share ``machine.cores``: as measured
    with the profile for this many workers on as many cores (``meta["share"]``), else
    evenly (a plan on fewer workers than profiled, a profile from elsewhere)."""
    if workers <= machine.cores:
        return 1.0
    meta = graph.meta
    if meta.get("shared_by") == workers and meta.get("share_cores") == machine.cores:
        return max(1.0, float(meta["share"]))
    return workers / machine.cores


def measured_machine(
    graph: LayerGraph, machine: LocalCalibration
) -> LocalCalibration:
    """``machine`` with the rates measured beside ``graph``'s profile in place of its own
    (``meta`` keys of :func:`~dreampipe.machine.rates.with_host_rates`), as the host is now."""
    meta = graph.meta
    found: dict[str, Any] = {key: float(meta[key]) for key in
                             ("step_bandwidth", "stash_copy_bandwidth") if key in meta}
    if "allreduce_bandwidth" in meta:
        found["bandwidth"] = f"{float(meta['allreduce_bandwidth']):.6g}B/s"
    return dataclasses.replace(machine, **found)


def local_topology(
    workers: int, machine: LocalCalibration, *, nodes: int = 1
) -> Topology:
    """``workers`` workers at ``machine.bandwidth``: one level, or with ``nodes`` > 1
    (``workers / nodes`` on each) two, the nodes joined at ``machine.outer_bandwidth``."""
    if workers < 1:
        raise ConfigError(f"workers={workers}: use at least 1 worker", "workers")
    if nodes > 1 and workers % nodes == 0:
        if machine.outer_bandwidth is None:
            raise ConfigError(
                f"nodes={nodes}: the machine's calibration holds no link between nodes; "
                f"measure it with 'torchrun --nnodes {nodes} ... dreampipe calibrate'", "nodes")
        parsed = Topology.parse(f"{nodes}x{workers // nodes}",
                                bandwidths=[machine.bandwidth, machine.outer_bandwidth],
                                latencies=[machine.latency_s, machine.outer_latency_s])
    else:
        parsed = Topology.parse(str(workers), bandwidths=[machine.bandwidth],
                                latencies=[machine.latency_s])
    return dataclasses.replace(parsed, overlap=machine.overlap)


def measured_topology(
    graph: LayerGraph, workers: int, machine: LocalCalibration, *, nodes: int = 1
) -> Topology:
    """:func:`local_topology` of ``machine`` as measured beside ``graph``'s profile
    (:func:`measured_machine`): the workers a plan for ``graph`` is priced on."""
    return local_topology(workers, measured_machine(graph, machine), nodes=nodes)


def local_costs(
    graph: LayerGraph, plan: Plan, microbatch_fraction: float,
    machine: LocalCalibration, *, nodes: int = 1,
) -> SimCosts:
    """Simulator costs of ``plan`` on this machine's workers.

    The profile's layer times plus the host time the runtime spends around
    them: posting each send, in each forward and backward the stage's own
    overhead (the factors in ``graph.meta`` that :mod:`~dreampipe.runplan.runtime_overhead`
    measured with the profile, as at the microbatch's size where the profile was also timed
    at a small batch, :mod:`~dreampipe.profiling.fixed_costs`; else the machine's
    ``stage_forward_s``), loading
    the microbatch's data, the loss (its forward and backward as measured with the
    profile, else the machine's ``loss_s``), each tensor-split layer's fixed cost
    (:func:`split_layer_seconds`), and each weight update (with the
    copy weight stashing makes where a microbatch in flight needs the old weights).
    Compute and updates run ``machine.corun_slowdown`` slower when workers run side
    by side, and with more workers than ``machine.cores`` every host-side
    cost stretches by the pace measured with the profile for that many
    workers, else by ``workers / cores``; a profile taken beside busy
    twins already holds the co-run slowdown. An all-reduce's start, measured
    into the backward, stretches with the backward it waits on, as does the
    weight-gradient part of each backward. Each
    forward and backward varies as the profile's passes did around their
    median (``SimCosts.jitter``), so replicas wait for the slower one and
    stages for each other as on the host. ``nodes``: see :func:`local_topology`.
    """
    from dreampipe.profiling.fixed_costs import meta_at_fraction
    from dreampipe.simulation.simulator import costs_from_profile

    topology = local_topology(plan.workers_used, machine, nodes=nodes)
    costs = costs_from_profile(graph, plan, topology, microbatch_fraction)
    meta = meta_at_fraction(graph, microbatch_fraction)  # as at the microbatch's size
    runtime_backward = meta.get("runtime_backward", 1.0)
    if "runtime_forward" in meta:  # the stage's own overhead is in the factor
        forward = [f * meta["runtime_forward"] for f in costs.forward_s]
    else:
        forward = [f + machine.stage_forward_s for f in costs.forward_s]
    backward = [b * runtime_backward for b in costs.backward_s]
    if "loss_forward_ms" in meta:  # measured with the profile
        forward[-1] += meta["loss_forward_ms"] / 1e3
        backward[-1] += meta["loss_backward_ms"] / 1e3
    else:
        forward[-1] += machine.loss_s
    for s, (fixed_forward, fixed_backward) in enumerate(split_layer_seconds(graph, plan, machine)):
        forward[s] += fixed_forward
        backward[s] += fixed_backward
    forward[0] += machine.batch_load_s
    if len(forward) > 1:
        forward[-1] += machine.batch_load_s
    share = _share(graph, plan.workers_used, machine)
    busy = share * _corun_factor(graph, plan.workers_used, machine)
    return dataclasses.replace(
        costs, forward_s=tuple(f * busy for f in forward),
        backward_s=tuple(b * busy for b in backward),
        weight_grad_s=tuple(w * runtime_backward * busy for w in costs.weight_grad_s),
        allreduce_s=tuple(a * share for a in costs.allreduce_s),
        allreduce_delay_s=tuple(d * runtime_backward * busy for d in costs.allreduce_delay_s),
        send_overhead_s=machine.send_overhead_s * share,
        send_copy_bandwidth=machine.send_copy_bandwidth / share,
        step_s=tuple(p / machine.step_bandwidth * busy for p in costs.parameter_bytes),
        stash_copy_bandwidth=machine.stash_copy_bandwidth / busy,
        jitter=_jitter(graph),
    )


def split_layer_seconds(graph: LayerGraph, plan: Plan, machine: LocalCalibration
                        ) -> list[tuple[float, float]]:
    """Per stage of ``plan``, the seconds (forward, backward) its tensor split adds per
    microbatch beyond the operator search's compute share and collectives: each layer
    of a split stage (``Input`` layers aside) runs through DTensor, whose host work per
    operator the machine measured per layer (``split_layer_forward_s``,
    ``split_layer_backward_s``), whatever the microbatch's size; a recomputing stage
    pays its forward's again in its backward. (0, 0) for an unsplit stage. docs/design.md
    §9.1."""
    found = []
    for st in plan.stages:
        if st.tensor_parallel <= 1:
            found.append((0.0, 0.0))
            continue
        layers = sum(1 for x in graph.layers[st.first:st.last + 1] if not x.is_input)
        forward = layers * machine.split_layer_forward_s
        backward = layers * machine.split_layer_backward_s + (forward if st.recompute else 0.0)
        found.append((forward, backward))
    return found


def _jitter(graph: LayerGraph) -> tuple[float, ...]:
    """Each profiled pass over the median pass (``meta["pass_ms"]``): how long a forward or
    backward may take against the median the layer times hold; empty without passes."""
    passes = [float(t) for t in graph.meta.get("pass_ms", ()) if float(t) > 0]
    middle = statistics.median(passes) if passes else 0.0
    return tuple(t / middle for t in passes) if middle > 0 else ()

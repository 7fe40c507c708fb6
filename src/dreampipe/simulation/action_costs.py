"""What the simulator charges: per-stage, per-microbatch costs, from a profile or a plan.

:class:`SimCosts` holds seconds and bytes per stage and per microbatch (one
minibatch or microbatch); :func:`costs_from_profile` derives them from the
layer profile with the planner's terms (:mod:`dreampipe.planning.costs`),
:func:`costs_from_plan` from a plan's own predictions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dreampipe.errors import ScheduleError
from dreampipe.planning.placement import check_fits
from dreampipe.planning.plan import Plan
from dreampipe.planning.topology import Topology
from dreampipe.planning.zero_terms import HALF_ALLREDUCE
from dreampipe.profiling.graph import LayerGraph

if TYPE_CHECKING:
    from dreampipe.planning.sync import Sync

__all__ = ["Bandwidth", "PlacedTopology", "SimCosts", "costs_from_plan", "costs_from_profile",
           "cut_bandwidth"]


@dataclass(frozen=True)
class PlacedTopology:
    """A topology whose schedule rank ``r`` sits on worker ``workers[r]`` (no workers: on
    worker ``r``)."""

    topology: Topology
    workers: tuple[int, ...] = ()

    def worker(self, rank: int) -> int:
        return self.workers[rank] if self.workers else rank


Bandwidth = Topology | PlacedTopology | tuple[tuple[float, ...], ...] | float


@dataclass(frozen=True, kw_only=True)
class SimCosts:
    """Costs per stage and per microbatch (one minibatch or microbatch), in s and bytes.

    ``activation_bytes[s]``/``gradient_bytes[s]`` cross the cut between stage
    s and s+1 (forward and backward; gradients default to the activations).
    ``weight_grad_s[s]`` is the weight-gradient part of ``backward_s[s]``,
    which a zero-bubble schedule runs as its own ``W`` action (the rest is
    its ``B``); empty: half of each backward, the split a profile without
    one is taken to have.
    ``bandwidth`` (bytes/s) between two ranks is a :class:`Topology` (rank i
    is worker i), a :class:`PlacedTopology`, a rank-by-rank table, or one
    figure for every link (``math.inf``: free communication). With a topology,
    transfers across an outer level share their units' links
    (:meth:`~dreampipe.planning.topology.Topology.links_between`); otherwise
    each directed pair of ranks has a link of its own. Empty per-stage tuples
    mean zeros.
    ``microbatch_fraction`` is the microbatch's share of a profiled minibatch; throughput
    is reported in profiled minibatches. ``send_overhead_s`` and
    ``send_copy_bandwidth`` give the sender's own time to post one message.
    ``stash_copy_bandwidth`` is the rate at which a ``STEP`` copies its
    stage's parameters when a microbatch in flight still holds the version it
    replaces (weight stashing's copy-on-write; ``math.inf``: free).
    ``gather_s[s]`` is a ZeRO-3 ``UNSHARD`` of stage s, the all-gather of its weights over
    its replicas; empty: half of each ``allreduce_s`` (a ring all-gather moves half the
    bytes of a ring all-reduce of the same tensor).
    ``allreduce_delay_s[s]`` is how far into its backward stage s's
    all-reduce can start at the earliest, taken as one block on one link
    (:func:`dreampipe.planning.costs.allreduce_end` less the all-reduce).
    ``jitter``: factors each forward and backward multiplies its cost by, one
    drawn per action (seeded: a simulation repeats exactly); how the
    profile's passes varied around their median, so that replicas wait for
    the slower one and stages for each other as in a run. Empty: every
    action takes exactly its cost.
    ``recompute_bytes[s]`` is what stage s's backward holds once while it
    recomputes a microbatch's activations (its input and what its layers keep; 0: the
    stage stashes them per microbatch in ``stash_bytes``). ``held_bytes[s]`` is what it
    holds besides its weights and microbatches, as the planner counts it: its largest
    backward's working set and the compute library's kernels (:mod:`~dreampipe.planning.
    held`). ``state_bytes[s]`` is what its weights' state takes beyond a weight and a
    gradient a value (the optimizer's moments, 32-bit masters; less where ZeRO shards the
    gradients and state over the replicas), as the planner's ``--precision`` and
    ``--optimizer`` price it; 0 by default.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    activation_bytes: tuple[float, ...] = ()
    gradient_bytes: tuple[float, ...] = ()
    bandwidth: Bandwidth = math.inf
    allreduce_s: tuple[float, ...] = ()
    allreduce_delay_s: tuple[float, ...] = ()
    parameter_bytes: tuple[float, ...] = ()
    stash_bytes: tuple[float, ...] = ()
    step_s: tuple[float, ...] = ()
    microbatch_fraction: float = 1.0
    send_overhead_s: float = 0.0
    send_copy_bandwidth: float = math.inf
    stash_copy_bandwidth: float = math.inf
    jitter: tuple[float, ...] = ()
    weight_grad_s: tuple[float, ...] = ()
    recompute_bytes: tuple[float, ...] = ()
    held_bytes: tuple[float, ...] = ()
    state_bytes: tuple[float, ...] = ()
    gather_s: tuple[float, ...] = ()
    steps_agree: bool = False

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        if n == 0 or len(self.backward_s) != n:
            raise ScheduleError(
                f"costs need forward_s and backward_s for every stage, got {len(self.forward_s)} "
                f"and {len(self.backward_s)} entries"
            )
        defaults = {"activation_bytes": n - 1, "allreduce_s": n, "allreduce_delay_s": n,
                    "parameter_bytes": n, "stash_bytes": n, "step_s": n,
                    "recompute_bytes": n, "held_bytes": n, "state_bytes": n}
        for name, size in defaults.items():
            value = tuple(getattr(self, name)) or (0.0,) * size
            if len(value) != size:
                raise ScheduleError(f"costs.{name} has {len(value)} entries; give {size}")
            object.__setattr__(self, name, value)
        gathers = tuple(self.gather_s) or tuple(a * HALF_ALLREDUCE for a in self.allreduce_s)
        if len(gathers) != n or any(not 0 <= g < math.inf for g in gathers):
            raise ScheduleError(f"costs.gather_s={list(gathers)}; give one time >= 0 a stage")
        object.__setattr__(self, "gather_s", gathers)
        grads = tuple(self.gradient_bytes) or self.activation_bytes
        if len(grads) != n - 1:
            raise ScheduleError(f"costs.gradient_bytes has {len(grads)} entries; give {n - 1}")
        object.__setattr__(self, "gradient_bytes", grads)
        weights = tuple(self.weight_grad_s) or tuple(b / 2 for b in self.backward_s)
        if len(weights) != n or any(not 0 <= w <= b for w, b in zip(
                weights, self.backward_s, strict=True)):
            raise ScheduleError(
                f"costs.weight_grad_s={list(weights)}; give one per stage, each between 0 "
                "and the stage's backward_s"
            )
        object.__setattr__(self, "weight_grad_s", weights)
        if not self.microbatch_fraction > 0:
            raise ScheduleError(f"microbatch_fraction={self.microbatch_fraction}; it must be "
                                "positive")
        if self.send_overhead_s < 0 or not self.send_copy_bandwidth > 0:
            raise ScheduleError(
                f"send_overhead_s={self.send_overhead_s}, send_copy_bandwidth="
                f"{self.send_copy_bandwidth}: give an overhead >= 0 and a bandwidth > 0"
            )
        if not self.stash_copy_bandwidth > 0:
            raise ScheduleError(
                f"stash_copy_bandwidth={self.stash_copy_bandwidth}: give a bandwidth > 0"
            )
        bad = [f for f in self.jitter if not 0 < f < math.inf]
        if bad:
            raise ScheduleError(f"costs.jitter holds {bad[0]}; every factor must be finite and > 0")

    @property
    def num_stages(self) -> int:
        return len(self.forward_s)

    def bandwidth_between(self, a: int, b: int) -> float:
        links = self.bandwidth
        if isinstance(links, tuple):
            return links[a][b]
        if isinstance(links, int | float):
            return float(links)
        placed = self._placed()
        assert placed is not None
        return placed.topology.bandwidth_between(placed.worker(a), placed.worker(b))

    def shares_links(self, ranks: int) -> bool:
        """Whether transfers among ranks ``0..ranks-1`` can share a server's link: the
        topology has an outer level and the ranks sit on more than one server."""
        placed = self._placed()
        if placed is None or len(placed.topology.levels) < 2:
            return False
        server = placed.topology.levels[0].count
        return len({placed.worker(r) // server for r in range(ranks)}) > 1

    def links_between(self, a: int, b: int) -> tuple[tuple[int, int, int], ...]:
        """The links a transfer from rank ``a`` to rank ``b != a`` holds (class doc)."""
        placed = self._placed()
        if placed is None:
            return ((0, a, b),)
        return placed.topology.links_between(placed.worker(a), placed.worker(b))

    def _placed(self) -> PlacedTopology | None:
        """The bandwidth as a topology and where each rank sits; None for a table of
        rank-to-rank figures or one figure."""
        links = self.bandwidth
        if isinstance(links, Topology):
            return PlacedTopology(links)
        return links if isinstance(links, PlacedTopology) else None


def costs_from_profile(
    graph: LayerGraph, plan: Plan, topology: Topology, microbatch_fraction: float = 1.0,
    sync: Sync | None = None,
) -> SimCosts:
    """Per-microbatch costs of ``plan``'s stages from the layer profile.

    Activations and stashed bytes scale linearly with ``microbatch_fraction`` (microbatch
    size / profiled minibatch), and compute too, but for a profile timed at a small batch
    as well, whose layers pay their fixed part whole (:mod:`~dreampipe.profiling.
    fixed_costs`). A replicated stage's
    all-reduce and its delay are the planner's (:func:`dreampipe.planning.
    pricing.stage_allreduce` on the microbatch's backward, ``sync`` over the workers
    that hold it, default :data:`~dreampipe.planning.sync.DEFAULT_SYNC`), and a
    transfer runs at the link between the workers of its two ranks.
    ``Input`` layers cost nothing (data loading, as the planner counts them).
    Stashed bytes per microbatch are the stage's input and what its layers keep
    for the backward, with the copy of its input it runs on where its first layer writes
    it, as the planner counts them (:func:`~dreampipe.planning.memory_terms.input_copies`).

    A tensor-split stage (``tensor_parallel > 1``) runs as its plan says:
    forward+backward is its ``compute_s`` (the operator search's time, its
    collectives included) and the forward ``forward_s``; its weights and
    stashed outputs are one worker's share of each layer's (:func:`dreampipe.
    planning.split_stage.layer_shares`). Schedule rank ``r`` sits on the first worker
    of its group (:meth:`~dreampipe.planning.plan.Plan.stage_workers`); split and
    unsplit stages may mix. A plan of ``virtual_stages = v`` puts its
    unreplicated stages ``v`` to a worker, stage ``s`` on the worker of stage
    ``s mod (stages / v)`` (interleaved 1F1B). A plan whose workers the
    topology lacks is a ScheduleError (:func:`~dreampipe.planning.placement.check_fits`).
    A recomputing stage's backward runs its forward again first (its
    all-reduce's delay grows by as much) and a microbatch keeps only its input;
    the recomputed activations are held once (``recompute_bytes``).
    """
    from dreampipe.planning.held import held_bytes
    from dreampipe.planning.memory_terms import input_copies
    from dreampipe.planning.pricing import stage_allreduce  # NumPy: only when used
    from dreampipe.planning.split_stage import layer_shares
    from dreampipe.planning.sync import DEFAULT_SYNC
    from dreampipe.profiling.fixed_costs import layer_times

    how = DEFAULT_SYNC if sync is None else sync

    if plan.num_layers != len(graph):
        raise ScheduleError(
            f"the plan covers {plan.num_layers} layers but the profile has {len(graph)}; "
            "simulate a plan with the profile it was made from"
        )
    check_fits(plan, topology, error=ScheduleError)
    workers = plan.workers_used
    cuts, copies = graph.cut_bytes(), input_copies(graph)
    layers = graph.layers
    times = layer_times(graph, microbatch_fraction)
    fwd, bwd, act, params, stash, allreduce, delay = [], [], [], [], [], [], []
    wgrad: list[float] = []
    again: list[float] = []
    held: list[float] = []
    for s, st in enumerate(plan.stages):
        span = layers[st.first:st.last + 1]
        held.append(float(held_bytes([float(x.working_bytes) * microbatch_fraction for x in span],
                                     [float(x.library_bytes or 0) for x in span],
                                     [x.kernel_kind for x in span])[0, -1]))
        if st.tensor_parallel > 1:
            shares = layer_shares(span, st.splits, st.tensor_parallel)
            fwd.append(st.forward_s * microbatch_fraction)
            again_s = st.forward_s if st.recompute else 0.0  # added below, as for any stage
            bwd.append((st.compute_s - st.forward_s - again_s) * microbatch_fraction)
            backward = [x.backward_ms / 1e3 * microbatch_fraction * c.compute_ms / x.compute_ms
                        if x.compute_ms > 0 else 0.0 for x, c in zip(span, shares, strict=True)]
            weights = [c.weight_bytes for c in shares]
            stash.append((copies[st.first] + sum(c.activation_bytes for c in shares))
                         * microbatch_fraction)
            weight_s = [b * x.weight_grad_share for b, x in zip(backward, span, strict=True)]
        else:
            timed = [(0.0, 0.0, 0.0) if x.is_input else t for x, t in
                     zip(span, times[st.first:st.last + 1], strict=True)]
            fwd.append(sum(f for f, _, _ in timed) / 1e3)
            backward = [b / 1e3 for _, b, _ in timed]
            weight_s = [w / 1e3 for _, _, w in timed]
            bwd.append(sum(backward))
            weights = [float(x.parameter_bytes) for x in span]
            stash.append((cuts[st.first] + copies[st.first] + sum(x.stash_bytes for x in span))
                         * microbatch_fraction)
        params.append(sum(weights) + (0 if st.tensor_parallel > 1
                                      else graph.reused_bytes(st.first, st.last)))
        wgrad.append(min(bwd[-1], sum(weight_s)))
        if s + 1 < plan.num_stages:
            act.append(cuts[st.last + 1] * microbatch_fraction)
        placed = plan.stage_workers(s)[::st.tensor_parallel]
        ar, late = stage_allreduce(backward, weights, placed, topology, how)
        again.append(stash[-1] if st.recompute else 0.0)
        if st.recompute:
            bwd[-1] += fwd[-1]
            late += fwd[-1] if ar > 0 else 0.0
            stash[-1] = cuts[st.first] * microbatch_fraction
        allreduce.append(ar)
        delay.append(late)
    return SimCosts(
        forward_s=tuple(fwd), backward_s=tuple(bwd), activation_bytes=tuple(act),
        bandwidth=_links(plan, topology, workers), allreduce_s=tuple(allreduce),
        allreduce_delay_s=tuple(delay), parameter_bytes=tuple(params),
        stash_bytes=tuple(stash), microbatch_fraction=microbatch_fraction,
        weight_grad_s=tuple(wgrad),
        recompute_bytes=tuple(again) if any(again) else (),
        held_bytes=tuple(held),
    )


def cut_bandwidth(plan: Plan, topology: Topology, s: int) -> float:
    """The slowest link between stage ``s``'s workers and stage ``s + 1``'s: what
    :func:`costs_from_plan` moves the cut's bytes at (``inf`` on one worker)."""
    return min(topology.bandwidth_between(x, y) for x in plan.stage_workers(s)
               for y in plan.stage_workers(s + 1))


def costs_from_plan(plan: Plan, topology: Topology, microbatch_fraction: float = 1.0) -> SimCosts:
    """Approximate costs from a plan's own predictions, when no profile is at hand.

    Forward takes the stage's ``forward_s`` and backward the rest of ``compute_s``
    (a plan saved without ``forward_s``: a third and two thirds, the usual ratio);
    each direction of the cut moves ``comm_s / 2`` worth of bytes at
    the slowest link across it; memory is unknown (zero). A plan whose workers the
    topology lacks is a ScheduleError, as for :func:`costs_from_profile`.
    """
    check_fits(plan, topology, error=ScheduleError)
    forward = [st.forward_s if st.forward_s > 0 else st.compute_s / 3 for st in plan.stages]
    fwd = tuple(f * microbatch_fraction for f in forward)
    bwd = tuple((st.compute_s - f) * microbatch_fraction
                for st, f in zip(plan.stages, forward, strict=True))
    act = []
    for s, a in enumerate(plan.stages[:-1]):
        bw = cut_bandwidth(plan, topology, s)
        act.append(a.comm_s / 2 * bw * microbatch_fraction if math.isfinite(bw) else 0.0)
    return SimCosts(
        forward_s=fwd, backward_s=bwd, activation_bytes=tuple(act),
        bandwidth=_links(plan, topology, plan.workers_used),
        allreduce_s=tuple(st.allreduce_s for st in plan.stages),
        allreduce_delay_s=tuple(st.allreduce_delay_s * microbatch_fraction for st in plan.stages),
        microbatch_fraction=microbatch_fraction,
    )


def _links(plan: Plan, topology: Topology, ranks: int) -> Bandwidth:
    """The links between the first ``ranks`` schedule ranks: the topology itself when rank
    i sits on worker i, else the topology through the plan's placement (a split rank at
    the first of its workers)."""
    where = {r: w for s, st in enumerate(plan.stages)
             for r, w in zip(st.ranks, plan.stage_workers(s)[::st.tensor_parallel], strict=True)
             if r < ranks}
    if all(r == w for r, w in where.items()):
        return topology
    return PlacedTopology(topology, tuple(where[r] for r in range(len(where))))

"""How a synchronous plan runs its updates, as data a plan file carries, and its simulation.

A plan of the synchronous objective (:class:`~dreampipe.planning.sync_plan.SyncPlan`)
is saved as a :class:`~dreampipe.planning.plan.Plan` whose figures count profiled
minibatches; what makes it the planned run, not some pipeline of those stages, is
:class:`SyncRun`: its schedule, the microbatches of one update, a microbatch's share of
a profiled minibatch, the layers whose backward runs their forward again (the blocks
recomputed), each stage's ZeRO level, and the number formats and optimizer its memory
was priced for. ``dreampipe plan -o`` writes it beside the plan (``"sync_run"``) and
``dreampipe simulate`` runs it unless told otherwise, so a saved plan simulates as the
planner checked it (:func:`simulate_run`, which that check calls too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dreampipe.errors import PlanError
from dreampipe.planning.plan import Plan
from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync import Sync
from dreampipe.planning.sync_plan import SyncPlan
from dreampipe.planning.sync_stage_option import layer_blocks
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.scheduling.actions import Schedule, ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.simulation.action_costs import costs_from_profile
from dreampipe.simulation.simulator import SimResult, costs_from_plan, simulate_schedule
from dreampipe.simulation.zero_costs import state_bytes, with_zero

__all__ = ["SYNC_RUN_KEY", "SyncRun", "simulate_run"]

#: The plan file's key for the run (a plan without it is simulated as any plan).
SYNC_RUN_KEY = "sync_run"


@dataclass(frozen=True)
class SyncRun:
    """One synchronous update of a saved plan (module doc). ``microbatches``: all the
    copies' microbatches in one update (global batch / microbatch size); ``fraction``:
    a microbatch's share of a profiled minibatch."""

    schedule: ScheduleKind
    microbatches: int
    fraction: float
    recomputed: tuple[int, ...]
    zero: tuple[int, ...]
    training: Training
    virtual_stages: int = 1

    @classmethod
    def of(cls, result: SyncPlan, training: Training) -> SyncRun:
        """The run ``result`` plans, priced with ``training``'s formats and optimizer."""
        return cls(ScheduleKind(result.schedule.value),
                   result.global_batch // result.microbatch_size,
                   result.microbatch_size / result.profile_batch,
                   tuple(sorted({i for st in result.stages for i in st.recomputed})),
                   tuple(st.option.zero for st in result.stages), training,
                   result.virtual_stages)

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.value, "microbatches": self.microbatches,
                "microbatch_fraction": self.fraction, "recomputed_layers": list(self.recomputed),
                "zero": list(self.zero), "precision": self.training.precision,
                "optimizer": self.training.optimizer, "virtual_stages": self.virtual_stages}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SyncRun:
        try:
            run = cls(ScheduleKind(data["schedule"]), int(data["microbatches"]),
                      float(data["microbatch_fraction"]),
                      tuple(int(i) for i in data["recomputed_layers"]),
                      tuple(int(z) for z in data["zero"]),
                      Training(data["precision"], str(data["optimizer"])),
                      int(data.get("virtual_stages", 1)))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed {SYNC_RUN_KEY} in the plan JSON: {exc!r}") from exc
        if run.microbatches < 1 or not run.fraction > 0:
            raise PlanError(f"{SYNC_RUN_KEY}: microbatches={run.microbatches}, "
                            f"microbatch_fraction={run.fraction}; give both above 0")
        return run

    def schedule_of(self, plan: Plan, updates: int) -> Schedule:
        """``updates`` updates of ``plan``'s stages as this run schedules them."""
        return build_schedule([st.replicas for st in plan.stages], self.schedule,
                              updates * self.microbatches, self.microbatches,
                              virtual_stages=self.virtual_stages)


def simulate_run(run: SyncRun, plan: Plan, graph: LayerGraph | None, topology: Topology,
                 sync: Sync, updates: int, record_events: bool = False,
                 steps_agree: bool = False) -> tuple[Schedule, SimResult]:
    """``updates`` updates of ``plan`` run as ``run`` says, priced from ``graph`` (its
    layers in the run's formats, the recomputed ones' backward running their forward
    again) or, without it, from the plan's stage figures; ``steps_agree``: the ranks
    agree before every update (:attr:`~dreampipe.simulation.action_costs.SimCosts.
    steps_agree`)."""
    schedule = run.schedule_of(plan, updates)
    if graph is None:
        costs = costs_from_plan(plan, topology, run.fraction)
    else:
        trained, once = _recomputing(run.training.trained(graph), run.recomputed, plan)
        costs = costs_from_profile(trained, plan, topology, run.fraction, sync)
        if any(once):  # a stage recomputing whole holds its own (costs_from_profile's)
            costs = replace(costs, recompute_bytes=tuple(
                max(b * run.fraction, whole) for b, whole in zip(
                    once, costs.recompute_bytes or (0.0,) * len(once), strict=True)))
    levels: Sequence[int] = run.zero
    costs = replace(with_zero(costs, schedule, levels), steps_agree=steps_agree,
                    state_bytes=state_bytes(run.training, costs.parameter_bytes, run.zero,
                                            schedule.replicas, graph))
    return schedule, simulate_schedule(schedule, costs, record_events=record_events)


def _recomputing(graph: LayerGraph, recomputed: Sequence[int], plan: Plan
                 ) -> tuple[LayerGraph, tuple[float, ...]]:
    """``graph`` with the ``recomputed`` layers' backward running their forward again,
    keeping only a block's input where the layer before it is recomputed too (a layer
    kept whole keeps its output, a stage's input is the stage's: Layer.saved_bytes); and
    per stage the largest recomputed block's kept tensors, which its backward holds once,
    as the planner prices them (docs/design.md §4.6)."""
    again, blocks = set(recomputed), layer_blocks(graph)
    starts = {st.first for st in plan.stages}
    layers, block_bytes = [], dict[object, int]()
    for i, x in enumerate(graph.layers):
        if i in again:
            block_bytes[blocks[i]] = block_bytes.get(blocks[i], 0) + x.stash_bytes
            carried = (i > 0 and i not in starts and i - 1 in again
                       and blocks[i - 1] != blocks[i])
            kept = graph.layers[i - 1].activation_bytes if carried else 0
            x = replace(x, backward_ms=x.backward_ms + x.forward_ms, saved_bytes=kept)
        layers.append(x)
    once = tuple(float(max((block_bytes[blocks[i]] for i in range(st.first, st.last + 1)
                            if i in again), default=0)) for st in plan.stages)
    return replace(graph, layers=tuple(layers)), once

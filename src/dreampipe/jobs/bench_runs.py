"""dreampipe's own bench runs, and the simulator's prediction for each.

``1f1b-flush`` (with and without fused weight-gradient accumulation) and
``gpipe`` train one update of ``batch`` samples per step, cut into the
workload's microbatches; ``pipedream`` trains minibatches of ``batch / 2``
with one update each. :mod:`dreampipe.api.bench` runs them on
:class:`dreampipe.Pipeline`.

The prediction profiles the model here with one thread at each unit size
(the profiler times autograd's plain path, so it does not know fused
accumulation), times each stage's SGD step, and simulates the timed
schedule, fill and drain included, as the measurement times it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from dreampipe.jobs.bench_names import DREAMPIPE_RUN_NAMES
from dreampipe.jobs.local import profile_as_worker
from dreampipe.jobs.machine import local_costs, local_topology
from dreampipe.jobs.workloads import Workload
from dreampipe.runtime.processes import pinned_threads
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.units import UnitLayout

__all__ = ["DREAMPIPE_RUNS", "DreampipeRun", "predict"]

#: Timed repeats per layer in the bench's profile (more than the default: less noise).
_REPEATS = 25


@dataclass(frozen=True)
class DreampipeRun:
    """One of dreampipe's runs: its schedule, and whether Linear layers fuse accumulation."""

    kind: ScheduleKind
    fused_accumulation: bool = True

    def minibatch(self, work: Workload) -> int:
        """Samples per ``Pipeline.step``: a PipeDream minibatch, or a whole update."""
        return work.per_worker if self.kind is ScheduleKind.PIPEDREAM else work.batch

    def layout(self, work: Workload) -> UnitLayout:
        """How each step's samples are cut into units."""
        if self.kind is ScheduleKind.PIPEDREAM:
            return UnitLayout(kind=self.kind, minibatch_size=self.minibatch(work))
        return UnitLayout(kind=self.kind, minibatch_size=work.batch,
                          microbatches=work.microbatches)

    def steps(self, work: Workload, updates: int) -> int:
        """``Pipeline.step`` calls that train ``updates`` of the workload's updates."""
        return updates * work.batch // self.minibatch(work)


#: dreampipe's runs by bench name, in the order the bench runs them.
DREAMPIPE_RUNS = dict(zip(DREAMPIPE_RUN_NAMES, (
    DreampipeRun(ScheduleKind.PIPEDREAM),
    DreampipeRun(ScheduleKind.FLUSH),
    DreampipeRun(ScheduleKind.FLUSH, fused_accumulation=False),
    DreampipeRun(ScheduleKind.GPIPE),
), strict=True))

def _update_seconds(work: Workload, stash: bool) -> tuple[float, ...]:
    """Per stage: one SGD step, plus (``stash``) the copy-on-write of the weights.

    PipeDream's stage keeps the old weights for units still in flight when it
    updates (DESIGN.md section 5), which costs one copy of its weights; the
    last stage never has a unit in flight at its step. Medians of a few
    timings here, one thread.
    """
    spec = work.spec()
    out = []
    with torch.random.fork_rng(devices=[]), pinned_threads(1):
        for s in range(len(work.stage_bounds)):
            params = list(spec.build(*work.stage_range(s), seed=work.seed).parameters())
            for p in params:
                p.grad = torch.zeros_like(p)
            opt = torch.optim.SGD(params, lr=work.lr)
            cost = _median_s(opt.step)
            if stash and s < len(work.stage_bounds) - 1:
                cost += _median_s(_copier(params))
            out.append(cost)
    return tuple(out)


def _copier(params: list[torch.nn.Parameter]) -> Callable[[], object]:
    return lambda: [p.detach().clone() for p in params]


def _median_s(fn: Callable[[], object], repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def predict(runs: Sequence[DreampipeRun], work: Workload) -> dict[DreampipeRun, float]:
    """Simulated samples/s of each run's timed steps, from a one-thread profile here."""
    from dreampipe.planning import planner
    from dreampipe.simulation.simulator import simulate_schedule

    spec = work.spec()
    topology = local_topology(len(work.stage_bounds))
    replicas = [1] * len(work.stage_bounds)
    graphs = {}
    out = {}
    for run in runs:
        layout = run.layout(work)
        if layout.unit_size not in graphs:
            graphs[layout.unit_size] = profile_as_worker(spec, layout.unit_size,
                                                         repeats=_REPEATS)
        graph = graphs[layout.unit_size]
        plan = planner.evaluate_plan(graph, topology, list(work.stage_bounds), replicas)
        costs = replace(local_costs(graph, plan, unit_fraction=1.0),
                        step_s=_update_seconds(work, run.kind is ScheduleKind.PIPEDREAM))
        steps = run.steps(work, work.steps)
        sim = simulate_schedule(layout.build(replicas, steps), costs, record_events=False)
        out[run] = steps * run.minibatch(work) / sim.makespan_s
    return out

"""dreampipe's own bench runs, and the simulator's prediction for each.

``1f1b-flush`` (with and without fused weight-gradient accumulation),
``gpipe``, ``zb-h1``, ``interleaved-1f1b`` (the workload's 4 chunks, 2 per
worker), ``zbv`` and ``dualpipev`` (the same 4 chunks in the V: chunks ``r`` and
``3 - r`` on worker ``r``) and ``2bw`` train one update of ``batch`` samples per step, cut into
the workload's microbatches; ``pipedream`` trains minibatches of ``batch / 2``
with one update each. :mod:`dreampipe.commands.bench` runs them on
:class:`dreampipe.Pipeline`.

The prediction profiles the model at each microbatch size as ``dreampipe
train`` does, one thread beside a busy twin, with the host's step and
stash-copy rates measured then (the profiler times autograd's plain path,
so it does not know fused accumulation), and simulates the timed schedule,
fill and drain included, as the measurement times it
(:mod:`dreampipe.runplan.prediction`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dreampipe.commands.bench_names import DREAMPIPE_RUN_NAMES
from dreampipe.commands.workloads import Workload
from dreampipe.machine.calibration import corun_twins, local_topology
from dreampipe.machine.measure import local_machine
from dreampipe.runplan.plan_choice import PlanAsk, choose_plan
from dreampipe.runplan.prediction import predict_samples_per_s
from dreampipe.runplan.worker_profile import profile_as_worker
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout

__all__ = ["DREAMPIPE_RUNS", "DreampipeRun", "predict"]

#: Timed repeats per layer in the bench's profile (more than the default: less noise).
_REPEATS = 25


@dataclass(frozen=True)
class DreampipeRun:
    """One of dreampipe's runs: its schedule, whether Linear layers fuse accumulation, and
    its stages per worker."""

    kind: ScheduleKind
    fused_accumulation: bool = True
    virtual_stages: int = 1

    def minibatch(self, work: Workload) -> int:
        """Samples per ``Pipeline.step``: a PipeDream minibatch, or a whole update."""
        return work.per_worker if self.kind is ScheduleKind.PIPEDREAM else work.batch

    def layout(self, work: Workload) -> MicrobatchLayout:
        """How each step's samples are cut into microbatches."""
        if self.kind is ScheduleKind.PIPEDREAM:
            return MicrobatchLayout(kind=self.kind, minibatch_size=self.minibatch(work))
        return MicrobatchLayout(kind=self.kind, minibatch_size=work.batch,
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
    DreampipeRun(ScheduleKind.ZB_H1),
    DreampipeRun(ScheduleKind.INTERLEAVED, virtual_stages=2),
    DreampipeRun(ScheduleKind.ZBV, virtual_stages=2),
    DreampipeRun(ScheduleKind.DUALPIPEV, virtual_stages=2),
    DreampipeRun(ScheduleKind.TWO_BW),
), strict=True))

def predict(runs: Sequence[DreampipeRun], work: Workload) -> dict[DreampipeRun, float]:
    """Simulated samples/s of each run's timed steps, from a one-thread profile here (none
    for a Hugging Face model: the profiler builds zoo models)."""
    if work.hf:
        return {}
    spec = work.spec()
    workers = work.workers
    machine = local_machine(workers)
    topology = local_topology(workers, machine)
    graphs = {}
    out = {}
    for run in runs:
        layout = run.layout(work)
        if layout.microbatch_size not in graphs:
            graphs[layout.microbatch_size] = profile_as_worker(
                spec, layout.microbatch_size, repeats=_REPEATS, twins=corun_twins(workers, machine),
                ref=work.kind.value, model_kwargs=work.model_kwargs)
        graph = graphs[layout.microbatch_size]
        v = run.virtual_stages
        ask = PlanAsk(workers=workers, stages=",".join(map(str, work.bounds(v)))) if v == 1 \
            else PlanAsk(workers=workers, given=work.plan(v, run.kind.placement))  # v a worker
        plan = choose_plan(graph, topology, ask).plan
        out[run] = predict_samples_per_s(graph, plan, layout, run.steps(work, work.steps),
                                         machine)
    return out

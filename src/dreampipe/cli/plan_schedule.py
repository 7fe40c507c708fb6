"""``dreampipe plan``'s schedule options: ``--schedule``, ``--semantics`` and
``--virtual-stages``.

``--schedule auto`` (the default) simulates the candidate schedules of
``--semantics`` on the plan and keeps the fastest that fits ``--memory``
(:func:`dreampipe.runplan.schedule_choice.choose_schedule`), printing a line per
candidate. ``--virtual-stages v`` plans several stages per worker instead: the
layers cut into ``workers x v`` stages of balanced compute, for interleaved 1F1B
(stage ``s`` on worker ``s mod workers``), or with ``--schedule zbv`` or
``dualpipev`` (which imply ``v = 2``) in a V, stage ``s`` and ``2 workers - 1 - s``
on one worker; ``--schedule auto`` weighs the three. The plan is simulated with its
schedule against 1f1b-flush on ``workers`` stages; it carries ``v`` and its
placement, so what runs it runs it so.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from dreampipe.cli.links import memory_limit
from dreampipe.cli.plan_sync import optimizer_terms
from dreampipe.errors import ConfigError
from dreampipe.planning.placement import Placement
from dreampipe.planning.plan import Plan
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runplan.schedule_choice import (
    EFFECTIVE,
    SEVERAL,
    Semantics,
    check_semantics,
    choose_schedule,
)
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.interleave import interleaved_plan
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout, default_microbatches
from dreampipe.simulation.action_costs import costs_from_profile, cut_bandwidth
from dreampipe.simulation.simulator import SimResult, simulate_schedule

__all__ = ["CHOSEN_KEY", "add_schedule_arguments", "chosen", "runs_several", "schedule_report",
           "several_report"]

_AUTO = "auto"
#: The plan file's record of the schedule ``dreampipe plan`` chose, which ``simulate`` runs.
CHOSEN_KEY = "chosen_schedule"


def chosen(data: dict[str, Any]) -> dict[str, Any]:
    """What a plan file records of the schedule chosen for it (``data``: a report's JSON)."""
    return {CHOSEN_KEY: {"schedule": data["schedule"], "microbatches": data["microbatches"]}}


def _semantics(args: argparse.Namespace) -> Semantics:
    """``--semantics``, sync where not given."""
    return Semantics(args.semantics or Semantics.SYNC.value)


def check_schedule_flags(args: argparse.Namespace) -> None:
    """Before any planning: a named ``--schedule`` beside ``--semantics`` of the other
    kind is refused (:func:`~dreampipe.runplan.schedule_choice.check_semantics`)."""
    if args.schedule not in (None, _AUTO) and args.semantics is not None:
        check_semantics(ScheduleKind(args.schedule), Semantics(args.semantics))


def add_schedule_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--schedule``, ``--semantics``, ``--microbatches`` and ``--virtual-stages``."""
    p.add_argument("--schedule", default=None,
                   choices=[_AUTO, *(k.value for k in ScheduleKind if k is not ScheduleKind.DP)],
                   help="schedule to report for the plan; auto (default): the fastest of "
                        "--semantics that fits --memory, simulated, with the reasons; zbv "
                        "and dualpipev plan 2 stages per worker in a V")
    p.add_argument("--semantics", choices=[s.value for s in Semantics], default=None,
                   help="sync (default): updates as one process makes them (zb-h1, zb-h2, "
                        "1f1b-flush, gpipe); async: stale weights (2bw, pipedream); any: "
                        "both, each rate divided by the epochs to target dreampipe's "
                        "convergence study measured for it, so an asynchronous schedule is "
                        "chosen only where it is predicted to reach the target sooner")
    p.add_argument("--microbatches", type=int, metavar="M",
                   help="microbatches per minibatch for the schedules that split one "
                        "(default: 4 per stage, rounded up to whole rounds of the "
                        "widest stage's replicas)")
    p.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="cut the layers into workers x V stages and report that plan: for "
                        "interleaved 1F1B, stage s on worker s mod workers (with an explicit "
                        "--schedule auto: the fastest of it, zbv and dualpipev, which place "
                        "2 a worker in a V)")


def schedule_report(
    args: argparse.Namespace, plan: Plan, graph: LayerGraph, topo: Topology
) -> tuple[list[str], dict[str, Any]]:
    """Text lines and JSON data for the schedule ``--schedule`` names or ``auto`` picks."""
    memory = memory_limit(args.memory, graph, topo)
    if args.microbatches is not None and args.microbatches < 1:
        raise ConfigError(f"microbatches={args.microbatches}; use 1 or more", "microbatches")
    batch = graph.batch_size
    if args.microbatches is not None and batch and args.microbatches > batch:
        raise ConfigError(
            f"microbatches={args.microbatches} splits a minibatch of {batch} (the profile's) "
            f"into more parts than it has samples; use at most {batch}, or plan with "
            "--global-batch B for a batch of several minibatches", "microbatches")
    replicas = [st.replicas for st in plan.stages]
    capped = bool(batch) and args.microbatches is None and default_microbatches(replicas) > batch
    asked = () if args.schedule in (None, _AUTO) else (ScheduleKind(args.schedule),)
    if asked and args.microbatches is not None:  # its rules: pipedream takes one
        MicrobatchLayout(kind=asked[0], microbatches=args.microbatches)
    semantics = _semantics(args)
    choice = choose_schedule(graph, plan, topo, semantics, memory,
                             batch if capped else args.microbatches, kinds=asked,
                             optimizer=optimizer_terms(args))
    fits = " that fits the memory limit" if memory else ""
    best = ("as asked" if asked else
            f"the schedule soonest to the target ({EFFECTIVE}){fits}"
            if semantics is Semantics.ANY else
            f"the fastest {semantics.value} schedule{fits}")
    lines = [f"schedule    {choice.kind.value}: {best}, by the simulator "
             f"({choice.microbatches} microbatches per minibatch):"]
    lines += [f"  {line}" for line in choice.reasons()]
    if capped:
        lines.append(f"  a minibatch of {batch} (the profile's) splits into at most {batch} "
                     "microbatches: plan with --global-batch B for a batch of several")
    picked = next(c for c in choice.candidates if c.kind is choice.kind)
    dp = plan.baselines_s.get("dp")
    if choice.kind.synchronous:
        below = (f", below data parallelism's {1 / dp:.2f}"
                 if dp and picked.minibatches_per_s < 1 / dp else "")
        lines.append(
            f"  note: {choice.kind.value} runs this plan at {picked.minibatches_per_s:.2f} "
            f"minibatches/s{below}; the plan, its times and "
            "speed-ups above are PipeDream's asynchronous pipeline's: plan with --global-batch "
            "B for a synchronous plan, or with --semantics async")
    data = {"schedule": choice.kind.value, "microbatches": choice.microbatches,
            "schedule_minibatches_per_s": picked.minibatches_per_s,
            "schedule_candidates": [
                {"schedule": c.kind.value, "microbatches": c.microbatches,
                 "minibatches_per_s": c.minibatches_per_s, "tried": not c.why_not,
                 "peak_memory_bytes": c.peak_memory_bytes, "fits": c.fits,
                 **({} if c.epochs is None else {
                     "epochs_vs_dp": None if math.isinf(c.epochs) else c.epochs,
                     "study": c.study})}
                for c in choice.candidates]}
    return lines, data


def runs_several(args: argparse.Namespace) -> bool:
    """Whether ``dreampipe plan`` plans several stages per worker: ``--virtual-stages``, or a
    V schedule."""
    return args.virtual_stages != 1 or args.schedule in _V_KINDS


def several_report(
    args: argparse.Namespace, graph: LayerGraph, topo: Topology
) -> tuple[Plan, list[str], dict[str, Any]]:
    """The plan of several stages per worker (``--virtual-stages``, or 2 for a V schedule),
    its table, and its simulated bubble against 1f1b-flush on one stage per worker."""
    v, workers = _stages_per_worker(args), topo.num_workers
    m = args.microbatches or 4 * workers
    cut = dataclasses.replace(interleaved_plan(graph, workers, v), topology=topo.describe())
    lines: list[str] = []
    data: dict[str, Any] = {}
    if args.schedule == _AUTO:
        choice = choose_schedule(graph, cut, topo, _semantics(args),
                                 memory_limit(args.memory, graph, topo), m,
                                 optimizer=optimizer_terms(args))
        kind, m = choice.kind, choice.microbatches
        lines = [f"schedule    {kind.value}: the fastest of {', '.join(k.value for k in SEVERAL)}"
                 f" on {v} stages per worker, by the simulator:"]
        lines += [f"  {line}" for line in choice.reasons()]
        data["schedule_candidates"] = [
            {"schedule": c.kind.value, "microbatches": c.microbatches, "tried": not c.why_not,
             "minibatches_per_s": c.minibatches_per_s} for c in choice.candidates]
    else:
        kind = ScheduleKind(args.schedule or ScheduleKind.INTERLEAVED.value)
    plan = _with_cuts(cut.placed(kind.placement), graph, topo)
    run = _simulate(graph, plan, topo, kind, m)
    if run.throughput_minibatches_per_s > 0:  # no closed form prices it: the simulator does
        plan = dataclasses.replace(plan,
                                   time_per_minibatch_s=1 / run.throughput_minibatches_per_s)
    flush = _simulate(graph, interleaved_plan(graph, workers, 1), topo, ScheduleKind.FLUSH, m)
    table = [f"{'stage':>5} {'layers':>9} {'worker':>6} {'compute ms':>10}"]
    for s, st in enumerate(plan.stages):
        table.append(f"{s:>5} {f'{st.first}..{st.last}':>9} "
                     f"{st.ranks[0]:>6} {st.compute_s * 1e3:>10.2f}")
    where = " in a V" if plan.placement is Placement.V else ""
    table.append(
        f"{kind.value}, {v} stages per worker{where} on {workers} workers, {m} microbatches: "
        f"{run.throughput_minibatches_per_s:.3f} minibatches/s, bubble "
        f"{100 * run.bubble_fraction:.1f}% (1f1b-flush on {workers} stages: "
        f"{100 * flush.bubble_fraction:.1f}%)")
    data.update({"schedule": kind.value, "virtual_stages": v, "workers": workers,
                 "microbatches": m, "placement": plan.placement.value,
                 "stage_workers": [st.ranks[0] for st in plan.stages],
                 "bubble_fraction": run.bubble_fraction,
                 "flush_bubble_fraction": flush.bubble_fraction,
                 "minibatches_per_s": run.throughput_minibatches_per_s})
    if kind is ScheduleKind.INTERLEAVED:  # the names these had before zbv and dualpipev
        data.update({"interleaved_bubble_fraction": run.bubble_fraction,
                     "interleaved_minibatches_per_s": run.throughput_minibatches_per_s})
    return plan, table + lines, data


_V_KINDS = tuple(k.value for k in ScheduleKind if k.placement is Placement.V)


def _stages_per_worker(args: argparse.Namespace) -> int:
    """``--virtual-stages``, 2 for a V schedule (which takes no other count); a
    ConfigError for a schedule that does not run several stages per worker."""
    v: int = args.virtual_stages
    asked = args.schedule
    if asked in _V_KINDS:
        if v not in (1, 2):
            raise ConfigError(f"virtual_stages={v} with schedule={asked}, which runs 2 stages "
                              "per worker in a V; drop --virtual-stages or give 2",
                              "virtual_stages", "schedule")
        return 2
    fits = [k.value for k in SEVERAL]
    if asked not in (None, _AUTO, *fits):
        raise ConfigError(f"schedule={asked} with virtual_stages={v}: several stages per "
                          f"worker run under {', '.join(fits)} (or auto); drop "
                          "--virtual-stages, or name one of those", "schedule",
                          "virtual_stages")
    return v


def _with_cuts(plan: Plan, graph: LayerGraph, topo: Topology) -> Plan:
    """``plan`` with each stage's ``comm_s``: its output and that output's gradient at the
    slowest link to the next stage's workers, as the simulator moves them, so that a plan
    JSON simulated without its profile still pays its cuts
    (:func:`~dreampipe.simulation.action_costs.costs_from_plan`)."""
    cuts = graph.cut_bytes()
    stages = list(plan.stages)
    for s, st in enumerate(stages[:-1]):
        bw = cut_bandwidth(plan, topo, s)
        comm = 2 * cuts[st.last + 1] / bw if math.isfinite(bw) else 0.0
        stages[s] = dataclasses.replace(st, comm_s=float(comm))
    return dataclasses.replace(plan, stages=tuple(stages))


def _simulate(graph: LayerGraph, plan: Plan, topo: Topology, kind: ScheduleKind,
              m: int) -> SimResult:
    schedule = build_schedule([1] * plan.num_stages, kind, m, m,
                              virtual_stages=plan.virtual_stages)  # placed as its kind says
    costs = costs_from_profile(graph, plan, topo, 1 / m)
    return simulate_schedule(schedule, costs, record_events=False)

"""``dreampipe plan``'s schedule options: ``--schedule``, ``--semantics`` and
``--virtual-stages``.

``--schedule auto`` (the default) simulates the candidate schedules of
``--semantics`` on the plan and keeps the fastest that fits ``--memory``
(:func:`dreampipe.runplan.schedule_choice.choose_schedule`), printing a line per
candidate. ``--virtual-stages v`` plans for interleaved 1F1B instead: the
layers cut into ``workers x v`` stages of balanced compute, stage ``s`` on
worker ``s mod workers``, simulated with that schedule against 1f1b-flush
on ``workers`` stages. The plan carries ``v``, so what runs it runs it so.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from dreampipe.cli.links import memory_limit
from dreampipe.errors import ConfigError
from dreampipe.planning.plan import Plan
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.runplan.schedule_choice import Semantics, choose_schedule
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.interleave import interleaved_plan, virtual_worker
from dreampipe.simulation.action_costs import costs_from_profile
from dreampipe.simulation.simulator import SimResult, simulate_schedule

__all__ = ["add_schedule_arguments", "interleaved_report", "schedule_report"]

_AUTO = "auto"


def add_schedule_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--schedule``, ``--semantics``, ``--microbatches`` and ``--virtual-stages``."""
    p.add_argument("--schedule", default=_AUTO,
                   choices=[_AUTO, *(k.value for k in ScheduleKind if k is not ScheduleKind.DP)],
                   help="schedule to report for the plan; auto (default): the fastest of "
                        "--semantics that fits --memory, simulated, with the reasons")
    p.add_argument("--semantics", choices=[s.value for s in Semantics],
                   default=Semantics.SYNC.value,
                   help="sync (default): updates as one process makes them (zb-h1, zb-h2, "
                        "1f1b-flush, gpipe); async: stale weights (2bw, pipedream)")
    p.add_argument("--microbatches", type=int, metavar="M",
                   help="microbatches per minibatch for the schedules that split one "
                        "(default: 4 per stage)")
    p.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="interleaved 1F1B: cut the layers into workers x V stages, stage s "
                        "on worker s mod workers, and report that plan")


def schedule_report(
    args: argparse.Namespace, plan: Plan, graph: LayerGraph, topo: Topology
) -> tuple[list[str], dict[str, Any]]:
    """Text lines and JSON data for the schedule ``--schedule`` names or ``auto`` picks."""
    memory = memory_limit(args.memory, graph, topo)
    if args.microbatches is not None and args.microbatches < 1:
        raise ConfigError(f"microbatches={args.microbatches}; use 1 or more", "microbatches")
    if args.schedule != _AUTO:
        return [f"schedule    {args.schedule} (as asked)"], {"schedule": args.schedule}
    choice = choose_schedule(graph, plan, topo, Semantics(args.semantics), memory,
                             args.microbatches)
    limit = " the memory limit" if memory else ""
    lines = [f"schedule    {choice.kind.value}: the fastest {args.semantics} schedule that "
             f"fits{limit}, by the simulator ({choice.microbatches} microbatches per "
             "minibatch):"]
    lines += [f"  {line}" for line in choice.reasons()]
    data = {"schedule": choice.kind.value, "microbatches": choice.microbatches,
            "schedule_candidates": [
                {"schedule": c.kind.value, "microbatches": c.microbatches,
                 "minibatches_per_s": c.minibatches_per_s, "tried": not c.why_not,
                 "peak_memory_bytes": c.peak_memory_bytes, "fits": c.fits}
                for c in choice.candidates]}
    return lines, data


def interleaved_report(
    args: argparse.Namespace, graph: LayerGraph, topo: Topology
) -> tuple[Plan, list[str], dict[str, Any]]:
    """The interleaved plan for ``--virtual-stages``, its table, and its simulated bubble
    against 1f1b-flush on one stage per worker."""
    v, workers = args.virtual_stages, topo.num_workers
    plan = dataclasses.replace(interleaved_plan(graph, workers, v), topology=args.topology)
    m = args.microbatches or 4 * workers
    inter = _simulate(graph, plan, topo, ScheduleKind.INTERLEAVED, m)
    flush = _simulate(graph, interleaved_plan(graph, workers, 1), topo, ScheduleKind.FLUSH, m)
    lines = [f"{'stage':>5} {'layers':>9} {'worker':>6} {'compute ms':>10}"]
    for s, st in enumerate(plan.stages):
        lines.append(f"{s:>5} {f'{st.first}..{st.last}':>9} "
                     f"{virtual_worker(s, plan.num_stages, v):>6} {st.compute_s * 1e3:>10.2f}")
    lines.append(
        f"interleaved-1f1b, {v} stages per worker on {workers} workers, {m} microbatches: "
        f"{inter.throughput_minibatches_per_s:.3f} minibatches/s, bubble "
        f"{100 * inter.bubble_fraction:.1f}% (1f1b-flush on {workers} stages: "
        f"{100 * flush.bubble_fraction:.1f}%)")
    data = {"virtual_stages": v, "workers": workers, "microbatches": m,
            "stage_workers": [virtual_worker(s, plan.num_stages, v)
                              for s in range(plan.num_stages)],
            "interleaved_bubble_fraction": inter.bubble_fraction,
            "flush_bubble_fraction": flush.bubble_fraction,
            "interleaved_minibatches_per_s": inter.throughput_minibatches_per_s}
    return plan, lines, data


def _simulate(graph: LayerGraph, plan: Plan, topo: Topology, kind: ScheduleKind,
              m: int) -> SimResult:
    schedule = build_schedule([1] * plan.num_stages, kind, m, m,
                              virtual_stages=plan.virtual_stages)
    costs = costs_from_profile(graph, plan, topo, 1 / m)
    return simulate_schedule(schedule, costs, record_events=False)

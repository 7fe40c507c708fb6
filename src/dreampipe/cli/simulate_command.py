"""``dreampipe simulate``: run any schedule of a plan through the simulator.

The input is a plan JSON (``dreampipe plan -o``) or a profile (ours, PipeDream's
graph.txt, a bundled pipedream:NAME or a gpt: profile by shape), planned for
``--topology`` first. A plan runs on the links it was made on: its preset or shape, with
``-b``/``--latency`` where the plan was made with them (without them that is an error
naming them), or ``--topology`` (with ``--profile`` to price it there) to run it on
another; it runs the schedule it was planned with (:mod:`.simulate_source`). PipeDream
runs ``--minibatches``
minibatches; the other pipelines run that many of ``--microbatches`` microbatches each;
``dp`` runs the whole model on the plan's workers, one full minibatch per worker per
update. ``interleaved-1f1b`` needs a plan made with ``--virtual-stages`` (which may only
repeat the plan's v), ``zbv`` and ``dualpipev`` one made with ``--schedule zbv`` (2
stages per worker in a V). A plan needs as many workers as its ranks.
``--schedule-file`` simulates a schedule PyTorch's pipelining wrote (``_dump_csv``: one
CSV line per rank of actions such as 0F1, 1RECV_B0, 0I0, 0W0, 2REDUCE_GRAD), one
minibatch of it repeated ``--minibatches`` times, on a plan of its unreplicated stages
(stage s on rank s mod ranks, or in a V: several a rank need a plan made with
--virtual-stages or --schedule zbv). The schedules: docs/design.md §7 (PyTorch's files:
§7.11); the simulator: docs/design.md §9.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dreampipe.cli.links import (
    GPT_HELP,
    TOPOLOGY_HELP,
    add_link_arguments,
    sync_from,
)
from dreampipe.cli.output_paths import check_output_paths
from dreampipe.cli.simulate_source import load_source
from dreampipe.errors import ConfigError, ScheduleError
from dreampipe.planning.placement import (
    Placement,
    check_schedule,
    check_virtual_count,
    virtual_stages_of,
)
from dreampipe.planning.plan import Plan
from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync import Sync
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import format_bytes
from dreampipe.scheduling.actions import Schedule, ScheduleKind
from dreampipe.scheduling.agreement import check_agreement
from dreampipe.scheduling.build import repeat_schedule
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout, default_microbatches
from dreampipe.scheduling.torch_csv import check_file_fits, read_torch_csv
from dreampipe.simulation.simulator import (
    SimCosts,
    SimResult,
    costs_from_plan,
    costs_from_profile,
    simulate_schedule,
)
from dreampipe.simulation.sync_run import simulate_run
from dreampipe.simulation.zero_costs import state_bytes, with_zero

__all__ = ["register"]

_DEFAULT_TOPOLOGY = "cluster-a"


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the ``simulate`` sub-command."""
    p = sub.add_parser(
        "simulate",
        help="simulate a schedule of a plan: throughput, bubble, memory, timeline",
        description=(__doc__ or "").replace("``", "'"),  # reST quotes read as plain
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", metavar="PLAN_OR_PROFILE",
                   help="plan JSON, or a profile to plan first: JSON, PipeDream graph.txt, "
                        f"pipedream:NAME, or {GPT_HELP}")
    p.add_argument("--topology", "-t", metavar="T",
                   help=f"{TOPOLOGY_HELP} (default: the plan's own, else {_DEFAULT_TOPOLOGY}; "
                        "another than a plan's own needs --profile)")
    add_link_arguments(p)
    p.add_argument("--schedule", choices=[k.value for k in ScheduleKind],
                   help="schedule (default: the one a saved plan was chosen with, else "
                        "pipedream; with --schedule-file, the file's kind: "
                        "zb-h1 if it has I and W, interleaved-1f1b if several stages a rank, "
                        "gpipe if each rank runs all its forwards first, else 1f1b-flush; zbv, "
                        "or dualpipev if it overlaps pairs, in a V)")
    p.add_argument("--schedule-file", type=Path, metavar="FILE.csv",
                   help="simulate this PyTorch pipelining schedule (its _dump_csv: a line of "
                        "actions per rank, compute only or with sends and receives) instead of "
                        "building one")
    p.add_argument("--minibatches", type=int, metavar="N",
                   help="minibatches to run (default: 4 per worker for pipedream and dp, 8 for "
                        "the others; rounded up to whole all-reduce rounds)")
    p.add_argument("--microbatches", type=int, metavar="M",
                   help="microbatches per minibatch for every schedule but pipedream and dp "
                        "(default: 4 per stage, GPipe's guidance, rounded up to whole "
                        "rounds of the widest stage's replicas)")
    p.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="interleaved-1f1b: stages per worker; default and only value: the "
                        "plan's (dreampipe plan --virtual-stages V saves it in the plan)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                   help="shard each replicated stage over its replicas at this ZeRO level "
                        "(a plan stage's own \"zero\" wins): 2 and 3 add each microbatch's "
                        "reduce-scatter, 3 the weights' gathers (default: 0)")
    p.add_argument("--clipped", action="store_true",
                   help="the run clips by the global gradient norm (max_grad_norm), scales an "
                        "fp16 loss or skips non-finite minibatches: every rank's first step "
                        "of an update waits for every other rank's, which makes the stages "
                        "of pipedream and 2bw wait for each other's backwards")
    p.add_argument("--profile", type=Path, metavar="FILE",
                   help="with a plan JSON: the profile it was made from, for exact costs and "
                        "memory (without it, costs come from the plan's predictions)")
    p.add_argument("--timeline", type=Path, metavar="OUT.png", help="draw a Gantt chart here")
    p.add_argument("--trace", type=Path, metavar="OUT.json",
                   help="write a Chrome trace here (opens in ui.perfetto.dev)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    check_output_paths(args.trace, args.timeline)
    with tqdm(total=4, desc="simulate", unit="step", file=sys.stderr, disable=None,
              leave=False) as bar:
        plan, graph, topology, source, run = load_source(args, _DEFAULT_TOPOLOGY)
        bar.update()
        wants_events = args.timeline is not None or args.trace is not None
        recorded = run  # the synchronous run the plan's prediction is of, if any
        if args.schedule or args.microbatches or args.schedule_file or args.zero:
            run = None  # the flags ask for another run of the plan's stages
        planned = run is not None  # a plan of the synchronous objective runs as planned
        if run is not None:
            updates = args.minibatches or 2
            schedule, result = simulate_run(run, plan, graph, topology, sync_from(args),
                                            updates, wants_events, args.clipped)
            kind, per_update = run.schedule, run.microbatches
            bar.update()
        else:
            if args.schedule_file is not None:
                schedule, layout, updates = _file_schedule(args, plan, source)
                kind, levels = schedule.kind, plan.zero_levels(args.zero)
            else:
                kind = ScheduleKind(args.schedule or ScheduleKind.PIPEDREAM.value)
                if args.clipped:
                    check_agreement(kind, [st.replicas for st in plan.stages], "--clipped")
                virtual = _virtual_stages(args, kind, plan, source)
                replicas, layout, updates = _microbatch_counts(args, kind, plan)
                levels = (args.zero,) if kind is ScheduleKind.DP else plan.zero_levels(
                    args.zero)
                schedule = layout.build(replicas, updates, plan.in_flight, virtual, zero=levels,
                                        steps_agree=args.clipped)
            costs = with_zero(_costs(plan, graph, topology, kind, layout.microbatch_fraction,
                                     sync_from(args)), schedule, levels)
            costs = dataclasses.replace(costs, steps_agree=args.clipped, state_bytes=state_bytes(
                Training(), costs.parameter_bytes, levels, schedule.replicas, graph))
            bar.update()
            result = simulate_schedule(schedule, costs, record_events=wants_events)
            per_update = layout.microbatches_per_update
        bar.update()
        title = (f"{plan.model or 'model'}: {kind.value}, config {result.config}, "
                 f"{topology.name or topology.shape}")
        if args.timeline is not None:
            from dreampipe.simulation.timeline import draw_timeline

            draw_timeline(result.events, args.timeline, title, schedule.num_ranks)
        if args.trace is not None:
            from dreampipe.simulation.chrome_trace import write_chrome_trace

            write_chrome_trace(result.events, args.trace)
        bar.update()
    limit = topology.memory_bytes if args.memory else None
    dp = kind is ScheduleKind.DP
    batch = plan.batch_size or (graph.batch_size if graph is not None else 0)
    info = {"topology": topology.name or topology.shape, "plan_config": plan.config,
            "config": result.config if dp else plan.config,
            "workers": schedule.num_ranks if dp else plan.workers_used,
            # without the profile the peaks are not known, nor what exceeds the limit
            "over_memory_ranks": ([] if limit is None else None) if graph is None else [
                r for r, peak in enumerate(result.peak_memory_bytes)
                if limit is not None and peak > limit],
            "memory_limit_bytes": limit, "minibatches": updates, "as_planned": planned,
            "planned_memory_bytes": [st.memory_bytes for st in plan.stages],
            "microbatches_per_update": per_update,
            # a plan of the synchronous objective predicts its run; any other, PipeDream's
            # steady state, whatever the schedule simulated
            "predicted_minibatches_per_s": plan.throughput_minibatches_per_s,
            "predicted_schedule": (ScheduleKind.PIPEDREAM if recorded is None
                                   else recorded.schedule).value,
            "batch_size": batch,
            # samples an update of the plan's synchronous run (0: not known, or not that run)
            "global_batch": batch * per_update * run.fraction if run is not None else 0,
            "memory_known": graph is not None}
    if args.json:
        known = {} if graph is not None else {"peak_memory_bytes": None}
        print(json.dumps({**result.summary(), **info, **known}))
    else:
        print(_report(result, info, schedule))
    return 0


def _file_schedule(
    args: argparse.Namespace, plan: Plan, source: str
) -> tuple[Schedule, MicrobatchLayout, int]:
    """(schedule, microbatch layout, weight updates): ``--schedule-file``'s minibatch
    repeated ``--minibatches`` times (default 8), on ``plan``'s stages."""
    _check_counts(args)
    virtual = virtual_stages_of(plan, args.virtual_stages, source)
    file = args.schedule_file
    period = read_torch_csv(file, ScheduleKind(args.schedule) if args.schedule else None)
    check_file_fits(period, [st.replicas for st in plan.stages], virtual, args.microbatches,
                    f"--schedule-file {str(file)!r}", plan.placement)
    updates = args.minibatches or 8
    layout = MicrobatchLayout(kind=period.kind, microbatches=period.num_microbatches)
    return repeat_schedule(period, updates), layout, updates


def _check_counts(args: argparse.Namespace) -> None:
    for name in ("minibatches", "microbatches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name}={value}; use 1 or more", name)
    if args.minibatches is not None and args.minibatches > _LONG_MINIBATCHES:
        print(f"note: simulating {args.minibatches:,} minibatches takes about a tenth of a "
              "millisecond each and stage (minutes, or hours); the steady state shows in a "
              "few hundred", file=sys.stderr)


#: ``--minibatches`` beyond this many is said to take long before it starts.
_LONG_MINIBATCHES = 100_000


def _microbatch_counts(
    args: argparse.Namespace, kind: ScheduleKind, plan: Plan
) -> tuple[tuple[int, ...], MicrobatchLayout, int]:
    """(replicas, microbatch layout, weight updates) for the chosen schedule.

    Sizes count profiled minibatches, so the layouts carry no sample counts.
    """
    replicas = tuple(st.replicas for st in plan.stages)
    workers = plan.workers_used
    _check_counts(args)
    if kind is ScheduleKind.PIPEDREAM:
        layout = MicrobatchLayout(kind=kind)
        return replicas, layout, layout.whole_rounds(replicas, args.minibatches or 4 * workers)
    if kind is ScheduleKind.DP:
        layout = MicrobatchLayout(kind=kind, workers=workers)
        return (workers,), layout, layout.updates_covering(args.minibatches or 4 * workers)
    layout = MicrobatchLayout(kind=kind,
                              microbatches=args.microbatches or default_microbatches(replicas))
    return replicas, layout, args.minibatches or 8


def _virtual_stages(args: argparse.Namespace, kind: ScheduleKind, plan: Plan, source: str) -> int:
    """The plan's stages per worker; ``--virtual-stages``, if given, must be the same, and
    more than one needs the interleaved schedule."""
    asked = args.virtual_stages
    check_virtual_count(asked)
    several = kind is ScheduleKind.INTERLEAVED or kind.placement is Placement.V
    if asked is not None and asked != 1 and not several:
        raise ConfigError(f"virtual_stages={asked} with schedule={kind.value}; only "
                          "interleaved-1f1b, zbv and dualpipev run several stages per worker",
                          "virtual_stages", "schedule")
    v = virtual_stages_of(plan, asked, source)
    check_schedule(plan, kind.value, source)
    return v


def _costs(
    plan: Plan, graph: LayerGraph | None, topology: Topology, kind: ScheduleKind, fraction: float,
    sync: Sync,
) -> SimCosts:
    if graph is None:
        if kind is ScheduleKind.DP:
            raise ScheduleError("the dp schedule re-plans the model as one stage and needs its "
                                "layers; pass --profile with the plan's profile")
        return costs_from_plan(plan, topology, fraction)
    if kind is ScheduleKind.DP:
        plan = Plan.from_config(len(graph), [0], [plan.workers_used], model=plan.model)
    return costs_from_profile(graph, plan, topology, fraction, sync)


def _rate(minibatches_per_s: float, info: dict[str, Any]) -> str:
    """A rate of profiled minibatches: in samples a second where the profile's batch is
    known, and a synchronous plan's run in updates a second too."""
    batch = info["batch_size"]
    if not batch:
        return f"{minibatches_per_s:.3f} minibatches/s (of the profile's batch)"
    samples = minibatches_per_s * batch
    if info["global_batch"]:
        return f"{samples:.1f} samples/s = {samples / info['global_batch']:.3f} updates/s"
    return f"{minibatches_per_s:.3f} minibatches/s of {batch} = {samples:.1f} samples/s"


def _predicted(kind: ScheduleKind, info: dict[str, Any]) -> str:
    """What the planner predicted for the plan, in the simulated rate's units, and for which
    run: a synchronous plan's own, or PipeDream's steady state."""
    predicted = info["predicted_minibatches_per_s"]
    if predicted <= 0:
        return ""
    batch, schedule = info["batch_size"], info["predicted_schedule"]
    rate = f"{predicted * batch:.1f} samples/s" if batch else f"{predicted:.3f}"
    run = (f"its {schedule} run" if schedule != ScheduleKind.PIPEDREAM.value
           else "in steady state" + ("" if kind is ScheduleKind.PIPEDREAM
                                     else " under pipedream"))
    return f" (planner predicted {rate} for plan {info['plan_config']}, {run})"


def _report(result: SimResult, info: dict[str, Any], schedule: Schedule) -> str:
    count = result.num_microbatches
    per = "" if count == info["minibatches"] else (
        f" ({count} microbatches, {info['microbatches_per_update']} per update)")
    runs = f"{info['minibatches']} minibatches{per}"
    if result.kind is ScheduleKind.DP:  # each worker computes a profiled minibatch an update
        runs = (f"{info['minibatches']} updates, each a minibatch on each of the "
                f"{info['workers']} workers{per}")
    if info["as_planned"]:
        runs = (f"the plan's synchronous run: {info['minibatches']} updates of "
                f"{info['microbatches_per_update']} microbatches")
    lines = [
        f"schedule    {result.kind.value}, config {info['config']} on {info['workers']} workers "
        f"({info['topology']}), {runs}",
        f"throughput  {_rate(result.throughput_minibatches_per_s, info)} over "
        f"{result.makespan_s:.3f} s" + _predicted(result.kind, info),
        f"bubble      {100 * result.bubble_fraction:.1f}% of rank time idle",
        "",
        f"{'rank':>4} {'stage':>5} {'busy s':>9} {'idle s':>9} {'idle %':>6} "
        f"{'peak memory':>12} {'versions':>8} {'in flight':>9}",
    ]
    for rank in range(schedule.num_ranks):
        stage = ",".join(map(str, schedule.stages_of_rank(rank)))
        idle = result.idle_s[rank]
        memory = (format_bytes(result.peak_memory_bytes[rank]) if info["memory_known"]
                  else "n/a")
        lines.append(
            f"{rank:>4} {stage:>5} {result.busy_s[rank]:>9.3f} {idle:>9.3f} "
            f"{100 * idle / result.makespan_s if result.makespan_s else 0:>5.1f}% "
            f"{memory:>12} {result.peak_versions[rank]:>8} {result.peak_in_flight[rank]:>9}")
    if not info["memory_known"]:
        if result.kind.splits_backward:
            lines.append("without --profile a backward's weight-gradient part (W) is taken "
                         "as half of it: pass --profile for each stage's own")
        lines.append("peak memory needs the profile: pass --profile with the plan JSON"
                     + ("; --memory is checked against it" if info["memory_limit_bytes"]
                        else ""))
    if info["as_planned"]:
        lines.append("peak memory counts weights, gradients and activations; as planned, "
                     "with the optimizer's state: " + ", ".join(
                         f"stage {s} {format_bytes(b)}"
                         for s, b in enumerate(info["planned_memory_bytes"])))
    if info["over_memory_ranks"]:
        lines.append(f"warning: ranks {info['over_memory_ranks']} peak above --memory "
                     f"{format_bytes(info['memory_limit_bytes'])}: this schedule of the plan "
                     "does not fit; plan it with --memory, or use a schedule that holds less")
    return "\n".join(lines)

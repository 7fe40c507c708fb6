"""``dreampipe simulate``: run any schedule of a plan through the simulator.

The input is a plan JSON (``dreampipe plan -o``) or a profile (ours, PipeDream's
graph.txt, a bundled pipedream:NAME or a gpt: profile by shape), planned for
``--topology`` first. A plan runs on the links it was made on: its preset or shape, with
``-b``/``--latency`` where the plan was made with them (without them that is an error
naming them), or ``--topology`` to run it on another. PipeDream runs ``--minibatches``
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
    memory_limit,
    profile_on,
    sync_from,
)
from dreampipe.cli.output_paths import check_output_paths
from dreampipe.cli.plan_schedule import CHOSEN_KEY
from dreampipe.errors import ConfigError, PlanError, ScheduleError, TopologyError
from dreampipe.planning.placement import (
    Placement,
    check_fits,
    check_schedule,
    check_virtual_count,
    virtual_stages_of,
)
from dreampipe.planning.plan import PLAN_FORMAT, Plan
from dreampipe.planning.sync import DEFAULT_SYNC, Sync
from dreampipe.planning.topology import Topology
from dreampipe.profiling.bundled import is_bundled
from dreampipe.profiling.gpt_spec import is_gpt_spec
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
from dreampipe.simulation.sync_run import SYNC_RUN_KEY, SyncRun, simulate_run
from dreampipe.simulation.zero_costs import with_zero

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
                   help="schedule (default: pipedream; with --schedule-file, the file's kind: "
                        "zb-h1 if it has I and W, interleaved-1f1b if several stages a rank, "
                        "else 1f1b-flush)")
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
        plan, graph, topology, source, run = _load(args)
        bar.update()
        wants_events = args.timeline is not None or args.trace is not None
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
                schedule = layout.build(replicas, updates, plan.in_flight, virtual, zero=levels)
            costs = dataclasses.replace(with_zero(_costs(
                plan, graph, topology, kind, layout.microbatch_fraction, sync_from(args)),
                schedule, levels), steps_agree=args.clipped)
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
    info = {"topology": topology.name or topology.shape, "plan_config": plan.config,
            "config": result.config if dp else plan.config,
            "workers": schedule.num_ranks if dp else plan.workers_used,
            "over_memory_ranks": [] if graph is None or limit is None else [
                r for r, peak in enumerate(result.peak_memory_bytes) if peak > limit],
            "memory_limit_bytes": limit, "minibatches": updates, "as_planned": planned,
            "planned_memory_bytes": [st.memory_bytes for st in plan.stages],
            "microbatches_per_update": per_update,
            "predicted_minibatches_per_s": plan.throughput_minibatches_per_s,
            "memory_known": graph is not None}
    if args.json:
        print(json.dumps({**result.summary(), **info}))
    else:
        print(_report(result, info, schedule))
    return 0


def _load(args: argparse.Namespace
          ) -> tuple[Plan, LayerGraph | None, Topology, str, SyncRun | None]:
    """The plan, its profile if known, the topology, where the plan comes from, and the
    synchronous run it was planned as (None: none recorded)."""
    source = Path(args.source)
    named_profile = is_bundled(args.source) or is_gpt_spec(args.source)
    data = None if named_profile else _json_object(source)
    if data is not None and data.get("format") == PLAN_FORMAT:
        named = f"plan {args.source!r}"
        try:
            plan = Plan.from_dict(data)
        except PlanError as exc:
            raise PlanError(f"{named}: {exc}") from exc
        topology = _plan_topology(plan.topology, args, named)
        check_fits(plan, topology, named)
        if args.profile is None:
            _check_unpriced(args, plan, topology, named)
        graph = profile_on(args.profile, topology) if args.profile is not None else None
        recorded = data.get(CHOSEN_KEY)
        if recorded is not None:
            _take_chosen(args, recorded, named)
        run = data.get(SYNC_RUN_KEY)
        return plan, graph, topology, named, None if run is None else SyncRun.from_dict(run)
    if data is not None and "format" not in data and "layers" not in data:
        raise PlanError(f"{str(source)!r} is neither a plan (its 'format' {PLAN_FORMAT!r}) nor "
                        "a profile; give a plan JSON from 'dreampipe plan -o' or a profile "
                        "from 'dreampipe profile'")
    if args.profile is not None:
        raise PlanError(f"--profile goes with a plan JSON, but {str(source)!r} is a profile; "
                        "drop --profile")
    topology = Topology.parse(args.topology or _DEFAULT_TOPOLOGY, args.bandwidth,
                              args.memory, args.latency)
    graph = profile_on(args.source, topology)
    from dreampipe.planning.options import PlanOptions
    from dreampipe.planning.planner import plan_pipeline

    plan = plan_pipeline(graph, topology,
                         PlanOptions(memory_bytes=memory_limit(args.memory, graph, topology)))
    return plan, graph, topology, f"the plan of {args.source!r}", None


def _take_chosen(args: argparse.Namespace, recorded: Any, named: str) -> None:
    """The schedule and microbatches ``dreampipe plan`` chose for the plan, where the flags
    name none: a plan simulates as it was planned to run."""
    kinds = {k.value for k in ScheduleKind}
    if not (isinstance(recorded, dict) and recorded.get("schedule") in kinds
            and type(recorded.get("microbatches")) is int and recorded["microbatches"] >= 1):
        raise PlanError(f"{named}: {CHOSEN_KEY}={recorded!r} is not a schedule and its "
                        "microbatches; write the plan again with 'dreampipe plan -o'")
    if args.schedule is not None or args.schedule_file is not None:
        return
    args.schedule = recorded["schedule"]
    if args.microbatches is None and ScheduleKind(args.schedule) not in (
            ScheduleKind.PIPEDREAM, ScheduleKind.DP):
        args.microbatches = recorded["microbatches"]


def _check_unpriced(args: argparse.Namespace, plan: Plan, topology: Topology,
                    named: str) -> None:
    """Without its profile a plan simulates on its own predictions, made on its own cluster
    and all-reduce: ``--sync`` would change nothing (an error naming the fix), and another
    topology only where its ranks sit (a note on stderr, so no run seems to answer what it
    does not)."""
    made = (f"the plan's own predictions (compute, all-reduce and cut times), made on "
            f"{plan.topology or 'its cluster'}")
    if args.sync != DEFAULT_SYNC.kind.value or args.ps_shards != 1:
        raise ConfigError(
            f"--sync {args.sync} for {named}, which has no profile here: its costs are {made}; "
            "add --profile (the profile it was made from) to price another all-reduce")
    if args.topology and plan.topology and topology.describe() != plan.topology:
        print(f"note: --topology {args.topology} places {named}'s ranks; its costs stay {made}: "
              "add --profile (the profile it was made from) to price it on these links",
              file=sys.stderr)


def _plan_topology(text: str, args: argparse.Namespace, named: str) -> Topology:
    """The topology a plan was made on (``text``, its description): ``--topology`` and
    the link flags where given, else the preset or shape the description starts with and
    the links the flags give. Without ``--topology``, links other than the plan's are an
    error: a plan simulated on other links than its own would say nothing of it."""
    flags = (args.bandwidth, args.memory, args.latency)
    if args.topology:
        return Topology.parse(args.topology, *flags)
    if not text:
        return Topology.parse(_DEFAULT_TOPOLOGY, *flags)
    for spec in (text, *text.split()[:1]):
        try:
            topology = Topology.parse(spec, *flags)
        except TopologyError:
            continue
        if " @ " in text and _links(topology.describe()) != _links(text):
            raise TopologyError(
                f"{named} was made on {text}, but {spec} gives "
                f"{_links(topology.describe())}; give the plan's links with -b and --latency "
                "(one per level, innermost first), or --topology and --profile to simulate "
                "it on another")
        return topology
    raise TopologyError(f"the plan's topology {text!r} is not a preset or shape; "
                        "pass --topology (e.g. cluster-a or 4x4)")


def _links(described: str) -> str:
    """A topology's description up to its levels' links, without its memory or device."""
    return described.split("), ", 1)[0] + ")" if "), " in described else described


def _json_object(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanError(f"cannot read {str(path)!r}: {exc.strerror}; check the path") from exc
    except UnicodeDecodeError:
        return None  # not a plan; load_graph says what it is not
    if not text.lstrip().startswith("{"):
        if path.suffix.lower() == ".json":
            raise PlanError(f"{str(path)!r} is not a JSON object; give a plan JSON from "
                            "'dreampipe plan -o' or a profile from 'dreampipe profile'")
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else None


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


def _report(result: SimResult, info: dict[str, Any], schedule: Schedule) -> str:
    count = result.num_microbatches
    per = "" if count == info["minibatches"] else (
        f" ({count} microbatches, {info['microbatches_per_update']} per update)")
    runs = f"{info['minibatches']} minibatches{per}"
    if info["as_planned"]:
        runs = (f"the plan's synchronous run: {info['minibatches']} updates of "
                f"{info['microbatches_per_update']} microbatches")
    lines = [
        f"schedule    {result.kind.value}, config {info['config']} on {info['workers']} workers "
        f"({info['topology']}), {runs}",
        f"throughput  {result.throughput_minibatches_per_s:.3f} minibatches/s over "
        f"{result.makespan_s:.3f} s"
        + (f" (planner predicted {info['predicted_minibatches_per_s']:.3f} for plan "
           f"{info['plan_config']} in steady state)"
           if info["predicted_minibatches_per_s"] > 0 else ""),
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
        lines.append("peak memory needs the profile: pass --profile with the plan JSON")
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

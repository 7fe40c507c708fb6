"""``dreampipe plan``: the fastest stages and replicas for a profile on a cluster.

Reads a dreampipe JSON profile, a PipeDream ``graph.txt`` or a profile by
shape (``gpt:...``, timed on the topology's device), runs the
planner and prints each stage with its costs and the predicted speedups
over data parallelism, a straight pipeline and GPipe; ``--json`` prints one
JSON object instead and ``-o`` saves the plan for ``simulate`` and ``train``.
A model that no layer plan fits in ``--memory`` gets a tensor-split plan
(every layer split over ``t`` workers of one server, config ``1t4``), shown
with what data parallelism and the smallest layer pipeline would need.

Then it checks the prediction by simulating the plan's PipeDream schedule
(:func:`confirm_by_simulation`, off with ``--no-check``). The check is
bounded at any scale: it simulates warm-up, drain and a few minibatches per
worker, at most ``--check-minibatches`` and at most
:data:`CHECK_STAGE_MINIBATCHES` / stages of them (the work, and so the time
and memory, grow with minibatches x stages), and it may end on a partial
all-reduce round, so replica counts such as 11-13-17-19 do not force
lcm = 46189 minibatches.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from dreampipe.cli.links import (
    GPT_HELP,
    TOPOLOGY_HELP,
    add_link_arguments,
    memory_limit,
    profile_on,
    sync_from,
    topology_from,
    unfit_note,
)
from dreampipe.cli.output_paths import check_output_file
from dreampipe.cli.plan_check import check_warning, format_check
from dreampipe.cli.plan_schedule import (
    add_schedule_arguments,
    check_schedule_flags,
    chosen,
    runs_several,
    schedule_report,
    several_report,
)
from dreampipe.cli.plan_sync import add_sync_arguments, optimizer_terms, run_sync, wants_sync
from dreampipe.cli.plan_why import stage_reasons
from dreampipe.errors import ConfigError
from dreampipe.planning.costs import GPIPE_MICROBATCHES_PER_STAGE, CostModel
from dreampipe.planning.memory_terms import STATELESS, OptimizerTerms
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.placement import check_virtual_count
from dreampipe.planning.plan import Heuristic, Plan, Stage
from dreampipe.planning.planner import memory_needs, plan_pipeline
from dreampipe.planning.split_stage import unfit_lines
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import format_bytes
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.simulation.simulator import SimResult, costs_from_profile, simulate_schedule

__all__ = [
    "CHECK_MINIBATCHES",
    "CHECK_STAGE_MINIBATCHES",
    "check_minibatches",
    "confirm_by_simulation",
    "format_plan",
    "layer_label",
    "plan_summary",
    "register",
]

_HEURISTICS = {
    Heuristic.LAYER_BLOCKS: "the layers were searched in blocks",
    Heuristic.WORKER_GRID: "stage ranges were searched on a grid of workers",
    Heuristic.WHOLE_SERVERS: "with --max-stages, outer stages were placed on whole servers",
    Heuristic.SHARED_LINKS: "the search priced each cut on its own, and its plan's cuts "
    "share a server's link",
    Heuristic.SERVER_COPIES: "under --memory, stages that recompute were replicated over "
    "servers only as one server's pipeline copied on each",
    Heuristic.WHOLE_ROUNDS: "under --memory, the fastest plan found was short of whole "
    "rounds in flight, so a plan of whole rounds stands in",
    Heuristic.LOOPS: "under --memory, neighbouring stages hold too few minibatches in "
    "flight for their 1F1B loop across a slow cut, which the search did not price",
}
_BASELINES = (("dp", "data parallelism"), ("straight", "a straight pipeline"),
              ("gpipe", f"GPipe at {GPIPE_MICROBATCHES_PER_STAGE} microbatches a stage"))

#: The check simulates at most this many minibatches unless ``--check-minibatches`` says.
CHECK_MINIBATCHES = 8192
#: ... and at most this many minibatches x stages whatever the cap: about 7 actions each,
#: a few microseconds per action to build, validate and simulate, so a few seconds.
CHECK_STAGE_MINIBATCHES = 50_000
#: Minibatches per schedule rank in the check's steady window (between warm-up and drain).
_STEADY_PER_WORKER = 4


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the ``plan`` sub-command."""
    p = sub.add_parser(
        "plan",
        help="cut a profiled model into replicated pipeline stages for a cluster",
        description=(
            "Run PipeDream's hierarchical dynamic program on a profile: choose where to cut "
            "the model and how many workers replicate each stage so that the slowest stage "
            "is as fast as possible. Prints each stage and the predicted speedup over data "
            "parallelism, the best straight pipeline and GPipe. A model too big for --memory "
            "as any layer plan gets a tensor-split plan instead: every layer split over t = "
            "2, 4, ... workers of one server (the fastest that fits), shown as config 1t4 "
            "with each layer's split."
        ),
        epilog=(
            "Examples: dreampipe plan pipedream:vgg16 --topology 4x4 --bandwidth 10GB/s "
            "--bandwidth 10Gbps -o plan.json; dreampipe plan "
            "gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=50257,batch=4 -t dgx-a100:2"
        ),
    )
    p.add_argument("profile", type=Path, metavar="PROFILE",
                   help="dreampipe profile JSON, PipeDream graph.txt, a bundled "
                        f"pipedream:NAME ('dreampipe show --list'), or {GPT_HELP}")
    p.add_argument("--topology", "-t", required=True, metavar="T", help=TOPOLOGY_HELP)
    add_link_arguments(p)
    p.add_argument("--straight", action="store_true",
                   help="no replication: one worker per stage")
    p.add_argument("--all-workers", action="store_true",
                   help="use every worker even when fewer would be faster")
    p.add_argument("--max-stages", type=int, metavar="N", help="at most N stages")
    p.add_argument("--exact", action="store_true",
                   help="search every layer however long it takes; by default a profile "
                        "with more layers than the topology's tables take in about half a "
                        "second is searched in blocks of layers, and the output says how far "
                        "from the optimum the plan may be")
    p.add_argument("--no-recompute", dest="recompute", action="store_false",
                   help="never recompute: by default, under --memory, a stage that fits only "
                        "if its backward recomputes its activations (one more forward) may "
                        "do so, marked 'r' in the config (e.g. 3r-1)")
    p.add_argument("--no-mixed-splits", dest="mixed_splits", action="store_false",
                   help="split a model over the workers of a server only as a whole, when no "
                        "layer plan fits --memory (what 'dreampipe train' runs); by default any "
                        "stage may run as replicas each split over 2, 4... workers of one "
                        "server (e.g. 2t4-3-1r) where faster or the only way to fit; the "
                        "runtime runs such plans except a split stage with replicas")
    p.add_argument("--cost-model", choices=[c.value for c in CostModel],
                   default=CostModel.DREAMPIPE.value,
                   help="dreampipe (default): one all-reduce per round (--sync) overlapped "
                        "with the backward, every link priced where it is crossed, Input "
                        "zeroed; pipedream: PipeDream's own "
                        "optimizer term for term, (compute + 4(m-1)/m|w|/B)/m added, Input "
                        "zeroed, every worker used, no memory limit")
    add_schedule_arguments(p)
    add_sync_arguments(p)
    p.add_argument("-o", "--output", type=Path, metavar="PLAN.json", help="save the plan here")
    p.add_argument("--json", action="store_true",
                   help="print exactly one JSON object on stdout instead of the table")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="do not check the prediction by simulating the plan's PipeDream "
                        "schedule afterwards (the check takes seconds at most; the JSON then "
                        "says \"check_skipped\": true)")
    p.add_argument("--check-minibatches", type=_at_least_one, default=None,
                   metavar="N",
                   help=f"simulate at most N minibatches in the check (default "
                        f"{CHECK_MINIBATCHES}): warm-up, drain and {_STEADY_PER_WORKER} per "
                        f"worker are enough for the steady state, and at most "
                        f"{CHECK_STAGE_MINIBATCHES} / stages are run whatever N, which keeps "
                        "the check to seconds; 'dreampipe simulate' runs any number")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    check_output_file("-o", args.output, "plan.json", inputs=(args.profile,))
    check_schedule_flags(args)
    topo = topology_from(args)
    graph = profile_on(args.profile, topo)
    if wants_sync(args):
        return run_sync(args, graph, topo)
    if runs_several(args):
        return _run_several(args, graph, topo)
    limit = memory_limit(args.memory, graph, topo)
    start = time.perf_counter()
    result = plan_pipeline(graph, topo, PlanOptions(
        memory_bytes=limit, straight=args.straight,
        allow_fewer_workers=not args.all_workers, max_stages=args.max_stages,
        cost_model=CostModel(args.cost_model), sync=sync_from(args), exact=args.exact,
        recompute=args.recompute, mixed_splits=args.mixed_splits,
        optimizer=optimizer_terms(args)))
    seconds = time.perf_counter() - start
    sim = confirm_by_simulation(result, graph, topo, args.check_minibatches or CHECK_MINIBATCHES
                                ) if args.check else None
    schedule_lines, schedule_data = schedule_report(args, result, graph, topo)
    if args.output:
        result.save(args.output, chosen(schedule_data))
    if args.json:
        summary = {**plan_summary(result, seconds), **schedule_data}
        needs = _split_needs(result, graph, topo, optimizer_terms(args))
        if needs is not None:
            summary["memory_needs_bytes"] = needs
        summary["check_skipped"] = sim is None
        summary["simulated_minibatches"] = None if sim is None else sim.num_microbatches
        summary["simulated_steady_minibatches"] = None if sim is None else sim.steady_microbatches
        summary["simulated_minibatches_per_s"] = (
            None if sim is None else sim.summary()["steady_throughput_minibatches_per_s"])
        summary["check_warning"] = None if sim is None else check_warning(result, sim)
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_plan(result, graph, topo, seconds, limit, optimizer_terms(args)))
        if sim is not None:
            print(format_check(result, sim))
            warning = check_warning(result, sim)
            if warning:
                print(warning)
        print("\n".join(schedule_lines))
        if args.cost_model == CostModel.PIPEDREAM:
            print(f"pipedream model: pipeline {result.time_per_minibatch_s * 1e3:.2f} ms, "
                  f"data parallel {result.baselines_s['dp'] * 1e3:.2f} ms per minibatch")
        if args.output:
            print(f"plan saved to {args.output}")
    return 0


def _run_several(args: argparse.Namespace, graph: LayerGraph, topo: Topology) -> int:
    """``--virtual-stages`` (or a V schedule): the plan of several stages per worker,
    reported and saved."""
    check_virtual_count(args.virtual_stages)
    plan, lines, data = several_report(args, graph, topo)
    if args.output:
        plan.save(args.output, chosen(data))
    if args.json:
        json.dump({**plan_summary(plan), **data}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    print("\n".join(lines))
    if args.output:
        print(f"plan saved to {args.output} ({plan.virtual_stages} stages per worker), with "
              f"its schedule, {data['schedule']}, which 'dreampipe simulate' runs")
    return 0


def _at_least_one(text: str) -> int:
    """``--check-minibatches``: a whole number >= 1 (argparse reports anything else)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number >= 1; give e.g. {CHECK_MINIBATCHES}, "
            "or --no-check to skip the check")
    return value


def check_minibatches(result: Plan, cap: int = CHECK_MINIBATCHES) -> int:
    """How many minibatches :func:`confirm_by_simulation` runs for ``result``.

    Enough for a steady state: the input stage's warm-up (every microbatch it admits
    before its first backward), as many again for the drain, and
    ``_STEADY_PER_WORKER`` per schedule rank (a tensor-split replica is one)
    between them; at most ``cap``, and at most :data:`CHECK_STAGE_MINIBATCHES`
    / stages so the time stays bounded.
    """
    if cap < 1:
        raise ConfigError(f"cap={cap} minibatches; use 1 or more", "cap")
    replicas = [st.replicas for st in result.stages]
    warm = replicas[0] * result.in_flight[0]
    wanted = 2 * warm + _STEADY_PER_WORKER * sum(replicas)
    return max(1, min(wanted, cap, CHECK_STAGE_MINIBATCHES // len(replicas)))


def confirm_by_simulation(
    result: Plan, graph: LayerGraph, topo: Topology, cap: int = CHECK_MINIBATCHES
) -> SimResult:
    """Run the plan's PipeDream schedule through the simulator to check the prediction.

    Simulates :func:`check_minibatches` minibatches, ending on a partial
    all-reduce round where the count is not a multiple of a stage's
    replicas; a tensor-split replica is one schedule rank. Compare the
    result's ``steady_throughput_minibatches_per_s`` (start-up and drain left
    out) with the planner's steady-state figure.
    """
    schedule = build_schedule([st.replicas for st in result.stages], ScheduleKind.PIPEDREAM,
                              check_minibatches(result, cap), in_flight=result.in_flight)
    return simulate_schedule(schedule, costs_from_profile(graph, result, topo), record_events=False)


def plan_summary(result: Plan, plan_time_s: float | None = None) -> dict[str, Any]:
    """The plan as JSON data plus the headline figures (speedups are null when unknown)."""
    out = result.to_dict()
    out["workers_used"] = result.workers_used
    out["throughput_minibatches_per_s"] = result.throughput_minibatches_per_s
    for key, _ in _BASELINES:
        out[f"speedup_over_{key}"] = (
            result.speedup_over(key) if key in result.baselines_s else None
        )
    if plan_time_s is not None:
        out["plan_time_s"] = plan_time_s
    return out


def layer_label(graph: LayerGraph, index: int, width: int = 26) -> str:
    """A layer's name, or its description when the name is PipeDream's bare ``nodeN``."""
    layer = graph.layers[index]
    text = layer.name
    if re.fullmatch(r"node\d+", layer.name) and layer.description:
        text = " ".join(layer.description.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def format_plan(
    result: Plan, graph: LayerGraph, topo: Topology, plan_time_s: float | None = None,
    memory_bytes: int | None = None, optimizer: OptimizerTerms = STATELESS,
) -> str:
    """The human report: topology, one row per stage, why each stage is as it is (against
    ``memory_bytes``, the limit planned with, beside what ``optimizer`` holds), prediction
    and speedups."""
    unheld = ("; planned without a memory limit (--memory holds the stages to it)"
              if memory_bytes is None and topo.memory_bytes else "")
    lines = [f"topology: {topo.describe()}{unheld}"]
    batch = f", minibatch {graph.batch_size}" if graph.batch_size else ""
    lines.append(f"model: {graph.model or 'model'}, {len(graph)} layers{batch}")
    head = (f"{'stage':>5} {'layers':>9}  {'first .. last':<56} {'x':>3} {'compute':>9} "
            f"{'comm':>8} {'allred':>8} {'time':>8} {'memory':>9}")
    lines += ["", head, f"{'':>5} {'':>9}  {'':<56} {'':>3} {'ms':>9} {'ms':>8} {'ms':>8} "
              f"{'ms/mb':>8} {'':>9}"]
    for s, st in enumerate(result.stages):
        names = f"{layer_label(graph, st.first)} .. {layer_label(graph, st.last)}"
        copies = (f"{st.replicas}t{st.tensor_parallel}" if st.tensor_parallel > 1
                  else str(st.replicas)) + ("r" if st.recompute else "")
        lines.append(
            f"{s:>5} {f'{st.first}..{st.last}':>9}  {names:<56} {copies:>3} "
            f"{st.compute_s * 1e3:>9.2f} {max(st.comm_s, st.shared_link_s) * 1e3:>8.2f} "
            f"{st.allreduce_s * 1e3:>8.2f} "
            f"{st.time_s * 1e3:>8.2f} {format_bytes(st.memory_bytes):>9}"
        )
    lines += [_format_splits(s, st) for s, st in enumerate(result.stages)
              if st.tensor_parallel > 1]
    per_server = topo.levels[0].count if len(topo.levels) > 1 else None
    lines += ["", *stage_reasons(result, graph, memory_bytes, optimizer, per_server)]
    unfit = unfit_note([st.memory_bytes for st in result.stages], topo, memory_bytes)
    if unfit is not None:
        lines.append(f"memory: {unfit}")
    rate = f"{result.throughput_minibatches_per_s:.2f} minibatches/s"
    if graph.batch_size:
        rate += f" = {result.throughput_minibatches_per_s * graph.batch_size:.0f} samples/s"
    lines += [
        "",
        f"config {result.config} on {result.workers_used} of {topo.num_workers} workers: "
        f"{result.time_per_minibatch_s * 1e3:.2f} ms per minibatch, {rate}",
    ]
    if result.optimality_gap > 0:
        how = " and ".join(_HEURISTICS[h] for h in result.heuristics) or "the search was cut"
        lines.append(f"  heuristic: {how}; at most "
                     f"{100 * result.optimality_gap:.1f}% slower than the optimum")
    else:
        lines.append("  exact: the fastest plan the search holds (no shortcut taken)")
    needs = _split_needs(result, graph, topo, optimizer)
    for key, label in _BASELINES:
        if key in result.baselines_s:
            lines.append(f"  {result.speedup_over(key):6.2f}x over {label} "
                         f"({result.baselines_s[key] * 1e3:.2f} ms)")
        elif needs is None:
            lines.append(f"  {label}: does not fit in memory")
    if needs is not None:
        lines += [f"  {line}" for line in unfit_lines(needs)]
    if plan_time_s is not None:
        lines.append(f"planned in {plan_time_s:.3f} s")
    return "\n".join(lines)


def _split_needs(result: Plan, graph: LayerGraph, topo: Topology, optimizer: OptimizerTerms
                 ) -> dict[str, int] | None:
    """What data parallelism and the smallest layer pipeline need per worker, beside what
    ``optimizer`` holds, for a plan split over workers as a whole because neither fits;
    None otherwise."""
    whole = result.num_stages == 1 and result.stages[0].tensor_parallel > 1
    return (memory_needs(graph, topo, optimizer) if whole and "dp" not in result.baselines_s
            else None)


def _format_splits(index: int, stage: Stage) -> str:
    """A split stage's splits, runs of layers with the same one merged: ``0..1 out, 2 in``."""
    runs: list[tuple[int, int, str]] = []
    for i, split in enumerate(stage.splits, start=stage.first):
        if runs and runs[-1][2] == split.value:
            runs[-1] = (runs[-1][0], i, split.value)
        else:
            runs.append((i, i, split.value))
    text = ", ".join(f"{a} {name}" if a == b else f"{a}..{b} {name}" for a, b, name in runs)
    return f"stage {index} split over {stage.tensor_parallel} workers: layers {text}"

"""``dreampipe plan``: the fastest stages and replicas for a profile on a cluster.

Reads a dreampipe JSON profile or a PipeDream ``graph.txt``, runs the
planner and prints each stage with its costs and the predicted speedups
over data parallelism, a straight pipeline and GPipe; ``--json`` prints one
JSON object instead and ``-o`` saves the plan for ``simulate`` and ``train``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from dreampipe.planning.costs import CostModel
from dreampipe.planning.plan import Plan
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.topology import PRESETS, Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.profiling.load import load_graph
from dreampipe.quantities import format_bytes
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.units import UnitLayout
from dreampipe.simulation.simulator import SimResult, costs_from_profile, simulate_schedule

__all__ = ["confirm_by_simulation", "format_plan", "layer_label", "plan_summary", "register"]

_BASELINES = (("dp", "data parallelism"), ("straight", "a straight pipeline"), ("gpipe", "GPipe"))


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the ``plan`` sub-command."""
    p = sub.add_parser(
        "plan",
        help="cut a profiled model into replicated pipeline stages for a cluster",
        description=(
            "Run PipeDream's hierarchical dynamic program on a profile: choose where to cut "
            "the model and how many workers replicate each stage so that the slowest stage "
            "is as fast as possible. Prints each stage and the predicted speedup over data "
            "parallelism, the best straight pipeline and GPipe."
        ),
        epilog=(
            f"Presets: {', '.join(sorted(PRESETS))}. Example: dreampipe plan vgg16.txt "
            "--topology 4x4 --bandwidth 10GB/s --bandwidth 10Gbps -o plan.json"
        ),
    )
    p.add_argument("profile", type=Path, metavar="PROFILE",
                   help="dreampipe profile JSON or PipeDream graph.txt")
    p.add_argument("--topology", "-t", required=True, metavar="T",
                   help="a preset or a shape like 16, 4x4 (servers x devices)")
    p.add_argument("--bandwidth", "-b", action="append", metavar="B",
                   help="bandwidth of one level, innermost first, e.g. 10GB/s then 10Gbps "
                        "(repeat per level; default: the preset's, or PCIe then 10Gbps)")
    p.add_argument("--memory", metavar="SIZE",
                   help="device memory, e.g. 16GB: reject stages whose stashed weights and "
                        "activations do not fit (default: no limit)")
    p.add_argument("--straight", action="store_true",
                   help="no replication: one worker per stage")
    p.add_argument("--all-workers", action="store_true",
                   help="use every worker even when fewer would be faster")
    p.add_argument("--max-stages", type=int, metavar="N", help="at most N stages")
    p.add_argument("--cost-model", choices=[c.value for c in CostModel],
                   default=CostModel.DREAMPIPE.value,
                   help="dreampipe (default): compute and communication overlap (max), ring "
                        "all-reduce 2(m-1)/m|w|/B per minibatch; pipedream: PipeDream's own "
                        "optimizer term for term, (compute + 4(m-1)/m|w|/B)/m added, Input "
                        "zeroed, every worker used, no memory limit")
    p.add_argument("-o", "--output", type=Path, metavar="PLAN.json", help="save the plan here")
    p.add_argument("--json", action="store_true",
                   help="print exactly one JSON object on stdout instead of the table")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    graph = load_graph(args.profile)
    topo = Topology.parse(args.topology, args.bandwidth, args.memory)
    start = time.perf_counter()
    result = plan_pipeline(
        graph, topo, memory_bytes=topo.memory_bytes if args.memory else None,
        straight=args.straight, allow_fewer_workers=not args.all_workers,
        max_stages=args.max_stages, cost_model=CostModel(args.cost_model),
    )
    seconds = time.perf_counter() - start
    sim = confirm_by_simulation(result, graph, topo)
    if args.output:
        result.save(args.output)
    if args.json:
        summary = plan_summary(result, seconds)
        summary["simulated_minibatches_per_s"] = sim.throughput_minibatches_per_s
        summary["simulated_minibatches"] = sim.num_units
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_plan(result, graph, topo, seconds))
        print(_format_confirmation(result, sim))
        if args.cost_model == CostModel.PIPEDREAM:
            print(f"pipedream model: pipeline {result.time_per_minibatch_s * 1e3:.2f} ms, "
                  f"data parallel {result.baselines_s['dp'] * 1e3:.2f} ms per minibatch")
        if args.output:
            print(f"plan saved to {args.output}")
    return 0


def confirm_by_simulation(result: Plan, graph: LayerGraph, topo: Topology) -> SimResult:
    """Run the plan's PipeDream schedule through the simulator to check the prediction.

    The planner's figure is the steady state; the simulation includes the
    pipeline's start-up, so it runs enough minibatches (at least 16 per
    worker, in whole all-reduce rounds) for start-up to matter little.
    """
    replicas = [st.replicas for st in result.stages]
    layout = UnitLayout(kind=ScheduleKind.PIPEDREAM)
    schedule = layout.build(replicas, layout.whole_rounds(replicas, 16 * result.workers_used))
    return simulate_schedule(schedule, costs_from_profile(graph, result, topo), record_events=False)


def _format_confirmation(result: Plan, sim: SimResult) -> str:
    predicted = result.throughput_minibatches_per_s
    ratio = sim.throughput_minibatches_per_s / predicted if predicted > 0 else 0.0
    return (
        f"simulated: {sim.throughput_minibatches_per_s:.2f} minibatches/s over "
        f"{sim.num_units} minibatches with start-up ({ratio:.0%} of the prediction; "
        f"{sim.bubble_fraction:.0%} of worker time idle)"
    )


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
    result: Plan, graph: LayerGraph, topo: Topology, plan_time_s: float | None = None
) -> str:
    """The human report: topology, one row per stage, prediction and speedups."""
    lines = [f"topology: {topo.describe()}"]
    batch = f", minibatch {graph.batch_size}" if graph.batch_size else ""
    lines.append(f"model: {graph.model or 'model'}, {len(graph)} layers{batch}")
    head = (f"{'stage':>5} {'layers':>9}  {'first .. last':<56} {'x':>3} {'compute':>9} "
            f"{'comm':>8} {'allred':>8} {'time':>8} {'memory':>9}")
    lines += ["", head, f"{'':>5} {'':>9}  {'':<56} {'':>3} {'ms':>9} {'ms':>8} {'ms':>8} "
              f"{'ms/mb':>8} {'':>9}"]
    for s, st in enumerate(result.stages):
        names = f"{layer_label(graph, st.first)} .. {layer_label(graph, st.last)}"
        lines.append(
            f"{s:>5} {f'{st.first}..{st.last}':>9}  {names:<56} {st.replicas:>3} "
            f"{st.compute_s * 1e3:>9.2f} {st.comm_s * 1e3:>8.2f} {st.allreduce_s * 1e3:>8.2f} "
            f"{st.time_s * 1e3:>8.2f} {format_bytes(st.memory_bytes):>9}"
        )
    rate = f"{result.throughput_minibatches_per_s:.2f} minibatches/s"
    if graph.batch_size:
        rate += f" = {result.throughput_minibatches_per_s * graph.batch_size:.0f} samples/s"
    lines += [
        "",
        f"config {result.config} on {result.workers_used} of {topo.num_workers} workers: "
        f"{result.time_per_minibatch_s * 1e3:.2f} ms per minibatch, {rate}",
    ]
    for key, label in _BASELINES:
        if key in result.baselines_s:
            lines.append(f"  {result.speedup_over(key):6.2f}x over {label} "
                         f"({result.baselines_s[key] * 1e3:.2f} ms)")
        else:
            lines.append(f"  {label}: does not fit in memory")
    if plan_time_s is not None:
        lines.append(f"planned in {plan_time_s:.3f} s")
    return "\n".join(lines)

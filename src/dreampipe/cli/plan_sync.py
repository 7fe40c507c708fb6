"""``dreampipe plan --global-batch B [--layout ...]``: the synchronous objective's plan.

With a global batch, ``--semantics sync`` plans an update as the chosen schedule runs
it (:func:`dreampipe.planning.sync_search.plan_sync`): the layout, the microbatches,
the schedule and the cuts. ``--layout`` prices a layout given by hand, the planner
choosing what it leaves out. The report gives each stage's terms, the time per update
and, for a profile by shape, the teraFLOP/s per GPU by Megatron-LM's count; then the
check simulates the plan's schedule for two updates and sets the simulated time
beside the prediction: the runtime's plan where it runs one, else one copy of the
pipeline from the plan's own stage terms (:mod:`dreampipe.simulation.sync_copy`),
as for interleaved copies of split stages.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from dreampipe.cli.links import memory_limit, sync_from, unfit_note
from dreampipe.errors import ConfigError
from dreampipe.planning.layout import LAYOUT_EXAMPLE, Layout, parse_layout
from dreampipe.planning.memory_terms import OptimizerTerms
from dreampipe.planning.splits import attention_heads
from dreampipe.planning.state_bytes import OPTIMIZER_COPIES, PRECISION_PARAM_BYTES, Training
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_objective import PipelineKind
from dreampipe.planning.sync_plan import SyncPlan
from dreampipe.planning.sync_search import plan_sync
from dreampipe.planning.sync_stage_option import layer_blocks
from dreampipe.planning.sync_why import OptionPrice, stage_options
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import format_bytes

__all__ = ["add_sync_arguments", "optimizer_terms", "run_sync", "wants_sync"]

#: Updates the check simulates.
_UPDATES = 2


def add_sync_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--global-batch``, ``--microbatch-size``, ``--layout``, ``--precision``,
    ``--optimizer``, ``--zero-levels``, ``--recompute-blocks`` and ``--whole-blocks``."""
    flags: dict[str, dict[str, Any]] = {
        "--global-batch": dict(type=int, metavar="B", help=(
            "samples an update: plan the synchronous objective, each update priced as its "
            "schedule runs it (bubble, all-reduce, microbatches chosen by the search)")),
        "--microbatch-size": dict(type=int, metavar="b", help=(
            "samples a microbatch (default: the search chooses a divisor of the global batch "
            "per copy of the pipeline)")),
        "--layout": dict(metavar="L", help=(
            f"price this layout, e.g. {LAYOUT_EXAMPLE} or t1-p1: tensor parallel t, pipeline "
            "stages p, virtual stages v, ZeRO level z, recomputed blocks r a stage (r0: "
            "none); data parallelism fills the workers")),
        "--precision": dict(choices=list(PRECISION_PARAM_BYTES), help=(
            "number formats of the synchronous objective's memory: bf16 keeps 16-bit weights "
            "and gradients and 32-bit masters (default: the profile's bytes a weight)")),
        "--optimizer": dict(choices=list(OPTIMIZER_COPIES), default="sgd", help=(
            "the optimizer whose state every stage holds beside its weights, which the "
            "plan's memory counts (default sgd: none; adam: two 32-bit moments a weight)")),
        "--zero-levels": dict(metavar="LEVELS", help=(
            "ZeRO levels each replicated stage may choose among where --layout names none, "
            "e.g. 0,1 to shard at most the optimizer's state (default: every level, 0 to "
            "3, each stage its own)")),
        "--recompute-blocks": dict(action="store_true", help=(
            "also weigh, for every stage, recomputing each of its blocks one at a time "
            "(Megatron-LM's full recomputation: it keeps each block's input, not its "
            "activations), as --layout's search does; the search takes several times "
            "longer (default: a stage keeps its activations or recomputes whole)")),
        "--whole-blocks": dict(action="store_true", help=(
            "cut only between whole blocks, the same number a stage, as Megatron-LM places "
            "them (the embedding on the first stage, the head on the last); default: the "
            "best cuts, inside blocks too")),
    }
    for flag, how in flags.items():
        p.add_argument(flag, **how)


def optimizer_terms(args: argparse.Namespace) -> OptimizerTerms:
    """What ``--optimizer`` holds beside every stage's weights: its state (its step's
    temporaries depend on the run's form of it, which a plan for any cluster does not
    know: ``dreampipe train`` counts them)."""
    return OptimizerTerms(state_copies=float(OPTIMIZER_COPIES[args.optimizer]))


def wants_sync(args: argparse.Namespace) -> bool:
    """Whether the flags ask for the synchronous objective; its flags without a global
    batch, or under ``--semantics async``, are errors naming the fix."""
    extra = [flag for flag, value in (("--microbatch-size", args.microbatch_size),
                                      ("--layout", args.layout),
                                      ("--precision", args.precision),
                                      ("--whole-blocks", args.whole_blocks or None),
                                      ("--recompute-blocks", args.recompute_blocks or None),
                                      ("--zero-levels", args.zero_levels))
             if value is not None]
    if args.global_batch is None:
        if extra:
            raise ConfigError(f"{extra[0]} prices a synchronous update, which needs its "
                              "global batch: add --global-batch B, e.g. --global-batch 512")
        return False
    if args.semantics not in (None, "sync"):
        raise ConfigError("--global-batch plans the synchronous objective; drop "
                          f"--semantics {args.semantics} or --global-batch")
    unread = [(flag, fix) for flag, given, fix in (
        ("--straight", args.straight, "fix the stages with --layout, e.g. --layout t1-p4"),
        ("--all-workers", args.all_workers, "fix the layout with --layout, e.g. t1-p4"),
        ("--max-stages", args.max_stages is not None, "fix the stages with --layout, e.g. "
                                                      "--layout t1-p4"),
        ("--microbatches", args.microbatches is not None, "give --microbatch-size instead"),
        ("--exact", args.exact, "its search states its own gap; drop --exact"),
        ("--cost-model", args.cost_model != "dreampipe", "PipeDream's terms price its "
                                                         "asynchronous pipeline only"),
        ("--check-minibatches", args.check_minibatches is not None,
         f"its check simulates {_UPDATES} updates; drop the flag")) if given]
    if unread:
        flag, fix = unread[0]
        raise ConfigError(f"{flag} with --global-batch: the synchronous objective does not "
                          f"read it; {fix}")
    return True


def _kinds(args: argparse.Namespace) -> tuple[PipelineKind, ...]:
    if args.schedule in (None, "auto"):  # None: not given, auto
        return tuple(PipelineKind)
    if args.schedule not in {k.value for k in PipelineKind}:
        raise ConfigError(f"--schedule {args.schedule} with --global-batch: the synchronous "
                          f"objective prices {', '.join(k.value for k in PipelineKind)}; "
                          "give one of them or auto")
    return (PipelineKind(args.schedule),)


def _mixed_levels(result: SyncPlan) -> str:
    """Where stages shard at different ZeRO levels (the layout names none then), which."""
    levels = [st.option.zero for st in result.stages]
    if len(set(levels)) < 2:
        return ""
    return "; ZeRO levels by stage " + "-".join(str(z) for z in levels)


def _zero_levels(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--zero-levels {text}: give ZeRO levels from 0 to 3, separated by "
                          "commas, e.g. 0,1,2,3") from None


def run_sync(args: argparse.Namespace, graph: LayerGraph, topo: Topology) -> int:
    """Plan, check and report the synchronous objective (module doc)."""
    if args.layout is not None and not args.layout.strip():
        raise ConfigError(f"--layout {args.layout!r} names no layout; give one like "
                          f"{LAYOUT_EXAMPLE}, or leave --layout out for the planner's choice")
    layout = parse_layout(args.layout) if args.layout else None
    if not graph.batch_size:
        raise ConfigError(
            f"--global-batch {args.global_batch} with profile {graph.model or 'model'!r}, "
            "which does not say the batch it was measured at (dreampipe show: 'batch "
            "unknown'): its times and activations cannot be priced per sample; profile the "
            "model again (dreampipe profile), or name a shape (gpt:layers=L,...)")
    if args.virtual_stages != 1:
        raise ConfigError(f"--virtual-stages {args.virtual_stages} with --global-batch: the "
                          "synchronous objective chooses them, or give them in --layout "
                          "(e.g. t1-p4-v2)")
    options = SyncOptions(
        global_batch=args.global_batch, microbatch_size=args.microbatch_size,
        memory_bytes=memory_limit(args.memory, graph, topo),
        training=Training(args.precision, args.optimizer), sync=sync_from(args),
        kinds=_kinds(args), layout=layout, recompute=args.recompute,
        recompute_blocks=args.recompute_blocks,
        tensor_split=args.mixed_splits, whole_blocks=args.whole_blocks,
        zero_levels=_zero_levels(args.zero_levels))
    start = time.perf_counter()
    result = plan_sync(graph, topo, options)
    seconds = time.perf_counter() - start
    simulated, why = _check(result, graph, topo, options) if args.check else (None, "--no-check")
    # the simulated update where the check ran (the objective's closed form bounds it)
    tflops = result.tflops_per_gpu(graph, simulated or result.time_per_update_s)
    notes = _layout_notes(result, graph, layout, topo.num_workers)
    unfit = unfit_note([st.memory_bytes for st in result.stages], topo, options.memory_bytes)
    notes += [] if unfit is None else [unfit]
    choices = stage_options(graph, topo, options, result)
    plan = result.plan()
    if args.output:
        if plan is None:
            raise ConfigError(f"-o {args.output}: layout {result.layout} interleaves stages "
                              "split or replicated over workers, which the runtime does not "
                              "run; drop -o or plan without virtual stages")
        from dreampipe.simulation.sync_run import SYNC_RUN_KEY, SyncRun

        plan.save(args.output, {SYNC_RUN_KEY: SyncRun.of(result, options.training).to_dict()})
    if args.json:
        out: dict[str, Any] = {**result.to_dict(), "model": graph.model,
                               "tflops_per_gpu": tflops, "plan_time_s": seconds,
                               "check_skipped": simulated is None, "notes": notes,
                               "simulated_time_per_update_s": simulated,
                               "stage_options": [[x.to_dict() for x in stage]
                                                 for stage in choices]}
        if plan is not None:
            out["config"] = plan.config
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0
    print("\n".join(_lines(result, graph, topo, tflops, simulated, why, seconds)))
    print("".join(f"note: {x}\n" for x in notes), end="")
    print("\n".join(_reasons(result, choices, options.memory_bytes)))
    if args.output:
        print(f"plan saved to {args.output}")
    return 0


def _layout_notes(result: SyncPlan, graph: LayerGraph, layout: Layout | None, workers: int
                  ) -> list[str]:
    """What the layout asked that the plan could not do as written: workers that no copy
    of its pipeline fills (they stay idle, and the TFLOP/s count the others only), a
    ``t`` that does not divide attention's heads (no split by heads: Megatron-LM's rule),
    and ``-rK`` above the blocks every stage holds, where a stage recomputes all of its
    own."""
    if layout is None:
        return []
    notes = []
    heads = sorted({a for x in graph.layers if (a := attention_heads(x)) is not None
                    and a % layout.t})
    if layout.t > 1 and heads:
        notes.append(f"--layout {layout.text}: t = {layout.t} does not divide attention's "
                     f"{', '.join(map(str, heads))} heads, so those layers are not split by "
                     "heads (as Megatron-LM splits them) but by batch or not at all; give a "
                     "t that divides the heads")
    idle = workers - result.workers_used
    if idle > 0:
        t, p, d = layout.t, layout.p, result.data_parallel
        notes.append(f"--layout {layout.text} runs {d} {'copy' if d == 1 else 'copies'} of "
                     f"its {t * p} workers: {idle} of the {workers} stay idle, and the TFLOP/s "
                     f"count the {result.workers_used} used; give t and p whose product "
                     f"divides {workers}")
    if not layout.recompute_blocks:
        return notes
    blocks = layer_blocks(graph)
    most = max(len({b for b in blocks[st.first:st.last + 1] if b is not None})
               for st in result.stages)
    if layout.recompute_blocks > most:
        notes.append(f"--layout {layout.text} recomputes {layout.recompute_blocks} blocks a "
                     f"stage, but no stage holds more than {most}: every stage recomputes "
                     f"all of its blocks, as r{most} would")
    return notes


def _check(result: SyncPlan, graph: LayerGraph, topo: Topology, options: SyncOptions
           ) -> tuple[float | None, str]:
    """The simulated time per update of ``result``'s schedule, or None and why not."""
    from dreampipe.simulation.sync_copy import simulate_copy
    from dreampipe.simulation.sync_run import SyncRun, simulate_run

    plan = result.plan()
    if plan is None:
        return simulate_copy(result), ""
    _, run = simulate_run(SyncRun.of(result, options.training), plan, graph, topo,
                          options.sync, _UPDATES)
    return run.makespan_s / _UPDATES, ""


def _lines(result: SyncPlan, graph: LayerGraph, topo: Topology, tflops: float | None,
           simulated: float | None, why: str, seconds: float) -> list[str]:
    lines = [f"topology: {topo.describe()}", f"model: {graph.model or 'model'}, "
             f"{len(graph)} layers", "",
             f"{'stage':>5} {'layers':>9} {'block':>5} {'option':>8} {'tau ms':>9} "
             f"{'cut ms':>8} {'tail ms':>8} {'held':>4} {'memory':>9}"]
    for s, st in enumerate(result.stages):
        lines.append(f"{s:>5} {f'{st.first}..{st.last}':>9} {st.block:>5} "
                     f"{st.option.label or '-':>8} {st.tau_s * 1e3:>9.2f} {st.cut_s * 1e3:>8.2f} "
                     f"{st.tail_s * 1e3:>8.2f} {st.held:>4} {format_bytes(st.memory_bytes):>9}")
    d, t, p = result.data_parallel, result.tensor_parallel, result.pipeline
    lines += [
        "",
        f"layout {result.layout}: {d} copies x {p} stages x {t} workers a replica = "
        f"{result.workers_used} of {topo.num_workers} workers; {result.schedule.value}"
        + (f", {result.virtual_stages} virtual stages" if result.virtual_stages > 1 else "")
        + _mixed_levels(result),
        f"  global batch {result.global_batch}: {result.microbatches} microbatches of "
        f"{result.microbatch_size} a copy; {result.time_per_update_s:.4g} s per update, "
        f"bubble {100 * result.bubble_fraction:.1f}%",
        "  exact: the fastest plan of the synchronous objective over every choice",
    ]
    rate = f", {tflops:.1f} TFLOP/s per GPU (Megatron-LM's count)" if tflops else ""
    if simulated is not None:
        ratio = simulated / result.time_per_update_s if result.time_per_update_s else 0.0
        lines.append(f"simulated: {simulated:.4g} s per update ({ratio:.0%} of the "
                     f"prediction){rate}")
    else:
        lines.append(f"simulated: skipped ({why}){rate}")
    lines.append(f"planned in {seconds:.3f} s")
    return lines


def _reasons(result: SyncPlan, choices: list[list[OptionPrice]], limit: int | None
             ) -> list[str]:
    """Per stage, why each other option on its layers lost: it does not fit, its pipeline
    term is longer, or its tail would end the update later."""
    end = max(st.tail_s for st in result.stages)
    lines = ["", "why each stage runs as it does (its other options on the same layers):"]
    for s, stage in enumerate(choices):
        mine = next(x for x in stage if x.chosen)
        why = []
        for x in (x for x in stage if not x.chosen):
            if not x.fits:
                why.append(f"{x.label} needs {format_bytes(x.memory_bytes)}"
                           + (f" of {format_bytes(limit)}" if limit else ""))
            elif x.value_s > mine.value_s * (1 + 1e-9):
                why.append(f"{x.label} {x.value_s / mine.value_s - 1:.1%} longer")
            elif x.tail_s > end:
                why.append(f"{x.label} ends {x.tail_s * 1e3:.2f} ms after its last backward, "
                           f"the update {end * 1e3:.2f} ms")
            else:
                why.append(f"{x.label} no faster")
        lines.append(f"  stage {s} {mine.label}, {format_bytes(mine.memory_bytes)}: "
                     + ("; ".join(why) or "its only option"))
    return lines

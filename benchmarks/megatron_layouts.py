"""Megatron-LM's published (t, p, d) layouts beside dreampipe's planner, on GPT-style models.

Profiles built from layer shapes (:mod:`dreampipe.profiling.gpt_shapes`): GPT-3
1.3B (Brown et al. 2020) and Megatron-LM's 8.3B (Shoeybi et al. 2019), on one
and eight servers of eight V100s (32 GB, NVLink inside a server, InfiniBand
between). Each published layout, ``t``-way tensor parallel with Megatron's
splits, ``p`` pipeline stages of equal blocks and ``d`` data-parallel
replicas, is priced with ``evaluate_plan`` under dreampipe's cost model; the
planner then plans the same profile with tensor splits, replication and
recomputation as per-stage choices. Prints the table and writes it, with an
introduction, to ``docs/megatron.md``.

    python benchmarks/megatron_layouts.py [--out PATH] [--no-write]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_sc21 import HEADING as SC21_HEADING

from dreampipe.planning.options import PlanOptions
from dreampipe.planning.plan import Plan
from dreampipe.planning.planner import evaluate_plan, plan_pipeline
from dreampipe.planning.splits import Split
from dreampipe.planning.topology import Level, Topology
from dreampipe.profiling.devices import V100_32GB
from dreampipe.profiling.gpt_shapes import GPT3_1_3B, MEGATRON_8_3B, GptShape, gpt_profile
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import format_bytes

__all__ = ["CASES", "Case", "Layout", "Row", "compute_row", "keep_sc21", "main",
           "megatron_splits", "render_doc", "render_table", "topology"]

_REPO = Path(__file__).resolve().parents[1]
_DEFAULT_OUT = _REPO / "docs" / "megatron.md"

#: A V100's sustained rate on a transformer's matrix products, as every profile by shape
#: takes it: the 39 TFLOP/s Megatron-LM reports for its 1.2B model on one GPU.
FLOPS = V100_32GB.sustained_flops
#: Device memory, the NVLink of one V100 (6 links of 25 GB/s) and a server's InfiniBand
#: share per GPU (8 x 100 Gb/s for 8 GPUs), with their per-message latencies.
MEMORY = V100_32GB.memory_bytes
NVLINK, NVLINK_LATENCY = 150e9, 5e-6
INFINIBAND, INFINIBAND_LATENCY = 12.5e9, 20e-6


def topology(servers: int) -> Topology:
    """``servers`` servers of 8 V100s."""
    return Topology((Level(8, NVLINK, NVLINK_LATENCY),
                     Level(servers, INFINIBAND, INFINIBAND_LATENCY)),
                    memory_bytes=MEMORY, name=f"{servers}x8 V100")


@dataclass(frozen=True)
class Layout:
    """Megatron-LM's (t, p, d): ``t``-way tensor parallel, ``p`` stages, ``d`` replicas;
    ``source`` says where it is published."""

    t: int
    p: int
    d: int
    source: str

    @property
    def label(self) -> str:
        return f"({self.t}, {self.p}, {self.d})"


@dataclass(frozen=True)
class Case:
    shape: GptShape
    servers: int
    published: tuple[Layout, ...]


_SHOEYBI = "Shoeybi et al. 2019"
_NARAYANAN = "Narayanan et al. 2021"
CASES = (
    Case(GPT3_1_3B, 1, (Layout(1, 1, 8, f"{_SHOEYBI}: a 1.2B model on one GPU, "
                                        "data parallel"),)),
    Case(GPT3_1_3B, 8, (Layout(1, 1, 64, f"{_SHOEYBI}: the same, 64 replicas"),)),
    Case(MEGATRON_8_3B, 1, (Layout(8, 1, 1, f"{_SHOEYBI}, Table 1: 8-way model parallel"),)),
    Case(MEGATRON_8_3B, 8, (
        Layout(8, 1, 8, f"{_SHOEYBI}: 8-way model x data parallel (d = 64 on 512 GPUs)"),
        Layout(8, 8, 1, f"{_NARAYANAN}: t = a server's GPUs, pipeline across servers"),
    )),
)

_MEGATRON = {"embed": Split.OUT, "ln1": Split.REPLICA, "attn_in": Split.OUT,
             "attn_out": Split.IN, "ln2": Split.REPLICA, "fc1": Split.OUT, "fc2": Split.IN,
             "final_ln": Split.REPLICA, "head": Split.OUT}


def megatron_splits(graph: LayerGraph, first: int, last: int) -> tuple[Split, ...]:
    """Megatron-LM's split of layers ``first..last``: attention by heads and the MLP by
    hidden units (``out`` then ``in``), LayerNorms replicated, embedding and head by
    columns."""
    return tuple(_MEGATRON[graph.layers[i].name.split(".")[-1]] for i in range(first, last + 1))


def _bounds(shape: GptShape, p: int) -> list[int]:
    """First layers of ``p`` stages of equal blocks (the embedding with the first, the
    final LayerNorm and head with the last)."""
    return [0] + [1 + 6 * (shape.layers * s // p) for s in range(1, p)]


def price_layout(graph: LayerGraph, shape: GptShape, topo: Topology, layout: Layout) -> Plan:
    """``layout`` under dreampipe's cost model and memory terms, with Megatron's splits
    and the activations kept (dreampipe recomputes whole stages, not block by block)."""
    bounds = _bounds(shape, layout.p)
    edges = [*bounds, len(graph)]
    split = layout.t > 1
    return evaluate_plan(
        graph, topo, bounds, [layout.d] * layout.p, memory_bytes=topo.memory_bytes,
        tensor_parallel=[layout.t] * layout.p if split else (),
        splits=[megatron_splits(graph, a, b - 1) for a, b in itertools.pairwise(edges)]
        if split else (),
    )


@dataclass(frozen=True)
class Row:
    """One line of the table: a published layout or the planner's plan, priced."""

    case: Case
    what: str
    source: str
    plan: Plan
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return bool(max(st.memory_bytes for st in self.plan.stages) <= MEMORY)

    @property
    def sequences_per_s(self) -> float:
        return float(self.case.shape.batch * self.plan.throughput_minibatches_per_s)


def _tpd(plan: Plan) -> str:
    """The plan as (t, p, d) where its stages agree on t and d, else 'mixed'."""
    widths = {st.tensor_parallel for st in plan.stages}
    replicas = {st.replicas for st in plan.stages}
    if len(widths) == 1 and len(replicas) == 1:
        return f"({widths.pop()}, {plan.num_stages}, {replicas.pop()})"
    return "mixed"


def compute_row(case: Case) -> list[Row]:
    """The published layouts of ``case`` and the planner's plan."""
    graph = gpt_profile(case.shape, FLOPS)
    topo = topology(case.servers)
    rows = [Row(case, layout.label, layout.source, price_layout(graph, case.shape, topo, layout))
            for layout in case.published]
    for memory in (None, topo.memory_bytes):
        start = time.perf_counter()
        plan = plan_pipeline(graph, topo, PlanOptions(memory_bytes=memory, recompute=True,
                                                      mixed_splits=True))
        rows.append(Row(case, f"planner {_tpd(plan)}",
                        "dreampipe plan" + (" --memory 32GB" if memory else ""), plan,
                        time.perf_counter() - start))
    return rows


def render_table(rows: Sequence[Row]) -> str:
    head = ("| model | GPUs | layout | config | ms / minibatch | sequences/s | memory / GPU "
            "| fits 32 GB | source |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        memory = max(st.memory_bytes for st in r.plan.stages)
        gap = (f" (heuristic, within {100 * r.plan.optimality_gap:.0f}%)"
               if r.plan.optimality_gap > 0 else "")
        lines.append(
            f"| {r.case.shape.name} | {8 * r.case.servers} | {r.what}{gap} | "
            f"`{r.plan.config}` | {r.plan.time_per_minibatch_s * 1e3:.1f} | "
            f"{r.sequences_per_s:.1f} | {format_bytes(memory)} | {'yes' if r.fits else 'no'} "
            f"| {r.source} |")
    return "\n".join(lines)


def findings(rows: Sequence[Row]) -> list[str]:
    """Per published layout: the planner's time beside it without a memory limit (agrees,
    or faster or slower under dreampipe's model), and what fits 32 GB (computed)."""
    out = []
    for case in dict.fromkeys(r.case for r in rows):
        mine = [r for r in rows if r.case is case]
        free, limited = mine[-2], mine[-1]
        for r in mine[:-2]:
            name = f"{case.shape.name} on {8 * case.servers} GPUs, {r.what}"
            ratio = r.plan.time_per_minibatch_s / free.plan.time_per_minibatch_s
            if r.plan.config == free.plan.config:
                line = f"- {name}: the planner agrees (`{r.plan.config}`) without a memory limit"
            else:
                verb = "faster" if ratio > 1 else "slower"
                line = (f"- {name}: without a memory limit the planner's "
                        f"`{free.plan.config}` is {max(ratio, 1 / ratio):.2f}x {verb} "
                        f"({free.plan.time_per_minibatch_s * 1e3:.1f} against "
                        f"{r.plan.time_per_minibatch_s * 1e3:.1f} ms per minibatch)")
            memory = format_bytes(max(s.memory_bytes for s in r.plan.stages))
            if r.fits:
                line += f"; the layout fits 32 GB ({memory})."
            else:
                line += (f"; the layout needs {memory} per GPU with its activations kept, "
                         f"and under 32 GB the planner's `{limited.plan.config}` takes "
                         f"{limited.plan.time_per_minibatch_s * 1e3:.1f} ms.")
            out.append(line)
    return out


def render_doc(rows: Sequence[Row]) -> str:
    planned = [r for r in rows if r.source.startswith("dreampipe plan")]
    seconds = "; ".join(
        f"{a.case.shape.name} on {8 * a.case.servers} GPUs {a.seconds:.0f} s without a limit, "
        f"{b.seconds:.0f} s under 32 GB" for a, b in zip(planned[::2], planned[1::2], strict=True))
    return f"""# Megatron-LM's layouts under dreampipe's planner

This page is generated: `python benchmarks/megatron_layouts.py` wrote it
(planner time: {seconds}); re-run it after changing the planner
(`--no-write` only prints the table).

Megatron-LM chooses its layouts by hand: `t`-way tensor parallelism inside a
server, `p` pipeline stages, `d` data-parallel replicas. Shoeybi et al.,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019), trained a 1.2B model on one GPU per replica and its 8.3B
model 8-way model parallel on the GPUs of a server, scaled by data
parallelism; Narayanan et al., "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM" (SC21), recommend tensor parallelism up to a
server's GPUs and pipeline parallelism across servers. Here each published
layout is priced with `evaluate_plan` under dreampipe's own cost model and
memory terms, beside the plans `plan_pipeline(..., PlanOptions(recompute=True,
mixed_splits=True))` chooses without a memory limit and under 32 GB, where
every stage may be split over 2, 4 or 8 GPUs of a server, replicated and
recompute its activations ([the planner](planner.md#tensor-splits-per-stage)).

Both papers checkpoint the activations of every block: the backward
recomputes one block at a time from its input, so a GPU holds every block's
input and one block's activations. dreampipe recomputes a whole stage
(one more forward of the stage, holding its activations once), which saves
memory only where a stage holds several minibatches; it has no term for
block-by-block checkpointing. The published layouts are therefore priced
with their activations kept, and the memory column says what they would
need so.

Reading the table: without a memory limit the planner's plans are
PipeDream pipelines whose stages keep a weight version and the activations
of every minibatch in flight, faster under the time model because they run
no split collectives, and far beyond 32 GB; they show where the time model
alone leads. The comparison that counts is under 32 GB, where the planner
mixes splits, replication and whole-stage recomputation, against published
layouts that fit a V100 only with block-by-block checkpointing.

- **Models.** Profiles built from layer shapes
  (`dreampipe.profiling.gpt_shapes`): GPT-3 XL, 1.3B (Brown et al., "Language
  Models are Few-Shot Learners", 2020: 24 layers, width 2048, 16 heads, 2048
  tokens), 4 sequences per minibatch; Megatron-LM's 8.3B (72 layers, width
  3072, 32 heads, 1024 tokens), 8 sequences per minibatch. Matrix products at
  {FLOPS / 1e12:.0f} TFLOP/s (what Megatron-LM sustains on one V100), backward twice
  the forward, activations in 16 bits as Megatron-LM counts them (34 sbh +
  5 a s^2 b bytes per block), weights and gradients in 32 bits, no optimizer
  state (dreampipe's memory terms count SGD's).
- **Cluster.** Servers of 8 V100s with {MEMORY // 10**9} GB, NVLink at
  {NVLINK / 1e9:.0f} GB/s inside a server, {INFINIBAND / 1e9:.1f} GB/s of InfiniBand per
  GPU between servers.
- **Pricing.** dreampipe's model is PipeDream's asynchronous pipeline: a
  minibatch is Megatron-LM's microbatch, a replicated stage all-reduces once
  per round of its replicas, overlapped with its backward, and a stage holds
  weight versions for the minibatches in flight. Megatron-LM flushes its
  pipeline every batch instead, so the absolute figures are dreampipe's, not
  Megatron-LM's measurements; the comparison is of layouts under one model.
  A published layout runs Megatron's splits (`megatron_splits`: attention
  by heads, the MLP's first layer by output and its second by input); the
  planner tries, per width, the operator search's fastest and leanest split.

{render_table(rows)}

What the comparison shows (computed):

{chr(10).join(findings(rows))}
"""


def keep_sc21(page: str, path: Path) -> str:
    """``page`` with the section ``megatron_sc21.py`` writes into ``path`` kept after it."""
    old = path.read_text() if path.is_file() else ""
    at = old.find(SC21_HEADING)
    return page if at < 0 else f"{page.rstrip()}\n\n{old[at:]}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="\n\n".join((__doc__ or "").split("\n\n")[:2]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=_DEFAULT_OUT, metavar="PATH",
                        help="write the page here (default: %(default)s)")
    parser.add_argument("--no-write", action="store_true",
                        help="only print the table; write nothing")
    args = parser.parse_args(argv)
    rows = [row for case in CASES for row in compute_row(case)]
    print(render_table(rows))
    print()
    print("\n".join(findings(rows)))
    if not args.no_write:
        args.out.write_text(keep_sc21(render_doc(rows), args.out))
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Megatron-LM's published runs (SC21, Tables 1 and 2) predicted by the synchronous objective.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC21): Table 1, ten GPT models from 1.7B to 1T parameters on 32
to 3,072 A100-80GB GPUs, and Table 2, PTD-P against ZeRO-3 for the 174.6B and 529.6B
models, each with the teraFLOP/s per GPU achieved (the rows: ``sc21_rows.py``). Each
row is priced with its published layout by
:func:`~dreampipe.planning.sync_search.plan_sync` on ``dgx-a100:N``, bf16 with Adam.
One figure is fitted: the sustained rate of matrix products, on the 1.7B row (data
parallel only), then used unchanged. The planner's own plan of each Table 1 row under
80 GB stands beside it, its search capped in time (``--no-own`` skips it). Prints the
tables and writes them into their section of ``docs/megatron.md``.

    python benchmarks/megatron_sc21.py [--rows 1.7B,18.4B] [--search-limit S] [--no-own]
        [--no-write]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from _docs import replace_block
from sc21_rows import ROWS, TABLE_2, Sc21Row

from dreampipe.errors import PlanError
from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync_objective import PipelineKind, slots
from dreampipe.planning.sync_plan import SyncPlan
from dreampipe.planning.sync_search import SyncOptions, plan_sync
from dreampipe.profiling.devices import A100_80GB
from dreampipe.profiling.gpt_spec import gpt_spec_profile

__all__ = [
    "HEADING",
    "MEMORY",
    "ROWS",
    "TABLE_2",
    "Priced",
    "Sc21Row",
    "fit_rate",
    "main",
    "own_plan",
    "price",
    "render_section",
    "render_tables",
    "write",
]

_REPO = Path(__file__).resolve().parents[1]
_DEFAULT_OUT = _REPO / "docs" / "megatron.md"
#: The section's heading in docs/megatron.md; ``megatron_layouts.py`` keeps what follows it.
HEADING = "## Megatron-LM's published runs, predicted"
_BLOCK = "sc21"
MEMORY = A100_80GB.memory_bytes
_TRAINING = Training("bf16", "adam")
#: A prediction further than this from the published figure is a miss.
_MISS = 0.15


def _tflops(row: Sc21Row, plan: SyncPlan) -> float:
    """Megatron-LM's count of the update's FLOPs, per second and GPU, in teraFLOP/s."""
    return row.spec.shape.update_flops(row.batch) / plan.time_per_update_s \
        / plan.workers_used / 1e12


@dataclass(frozen=True)
class Priced:
    """A row's published layout as dreampipe prices it, matrix products at ``rate``."""

    row: Sc21Row
    plan: SyncPlan
    rate: float
    seconds: float

    @property
    def tflops(self) -> float:
        return _tflops(self.row, self.plan)

    @property
    def ratio(self) -> float:
        return self.tflops / self.row.tflops

    @property
    def matmul_share(self) -> float:
        """Megatron-LM's FLOPs at the fitted rate, over the update's time."""
        return self.tflops * 1e12 / self.rate

    @property
    def cut_share(self) -> float:
        """The largest stage's cuts over an update (each microbatch, each chunk), over the
        update's time: part of "the rest"."""
        p = self.plan
        return max(st.cut_s for st in p.stages) * p.microbatches * p.virtual_stages \
            / p.time_per_update_s

    @property
    def imbalance(self) -> float:
        """The update's time over what it would take with every stage (chunk) at their
        mean ``tau + cut``, less one: what the objective's largest-stage rule charges for
        unequal stages, the head's and the embedding's."""
        p = self.plan
        factor = slots(p.schedule, p.pipeline, p.microbatches, p.virtual_stages).factor
        mean = sum(st.tau_s + st.cut_s for st in p.stages) / len(p.stages)
        return p.time_per_update_s / (factor * mean + max(st.tail_s for st in p.stages)) - 1

    @property
    def per_worker(self) -> float | None:
        """Under interleaving, the prediction's ratio to the published figure were each
        worker charged the sum of its chunks, ``m max_w sum_c (tau + cut) + (p - 1)
        max_c (tau + cut)``, instead of ``v m + p - 1`` times its largest chunk (None
        without interleaving): what the objective's largest-chunk rule costs the row."""
        p = self.plan
        if p.virtual_stages < 2:
            return None
        terms = [st.tau_s + st.cut_s for st in p.stages]
        sums = [sum(terms[w::p.pipeline]) for w in range(p.pipeline)]
        time = p.microbatches * max(sums) + (p.pipeline - 1) * max(terms) \
            + max(st.tail_s for st in p.stages)
        return self.ratio * p.time_per_update_s / time

    @property
    def memory(self) -> float:
        return max(st.memory_bytes for st in self.plan.stages)

    @property
    def fits(self) -> bool:
        """Whether every stage (chunk) fits its share of 80 GB as the objective holds it,
        ``1/v`` a chunk with its worker's microbatches in flight (a bound)."""
        return self.memory <= MEMORY / self.plan.virtual_stages


def price(row: Sc21Row, rate: float) -> Priced:
    """``row``'s published layout, matrix products at ``rate`` FLOP/s, its cuts chosen to
    fit 80 GB as the run did; interleaved rows, and rows no cuts fit, without the limit
    (the objective holds an interleaved chunk to a bound, :attr:`Priced.fits`)."""
    graph = gpt_spec_profile(row.spec, A100_80GB, flops=rate)
    kind = PipelineKind.INTERLEAVED if row.v > 1 else PipelineKind.FLUSH
    start = time.perf_counter()
    opts = SyncOptions(global_batch=row.batch, microbatch_size=row.microbatch,
                       training=_TRAINING, kinds=(kind,), layout=row.layout,
                       memory_bytes=MEMORY if row.v == 1 else None)
    try:
        plan = plan_sync(graph, row.topology, opts)
    except PlanError:
        plan = plan_sync(graph, row.topology, replace(opts, memory_bytes=None))
    return Priced(row, plan, rate, time.perf_counter() - start)


def fit_rate(row: Sc21Row = ROWS[0]) -> float:
    """The matrix products' sustained rate at which ``row`` prices at its published
    teraFLOP/s (fixed-point iteration; the prediction grows with the rate)."""
    rate = A100_80GB.sustained_flops
    for _ in range(50):
        ratio = price(row, rate).ratio
        if abs(ratio - 1) < 1e-6:
            return rate
        rate /= ratio
    raise RuntimeError(f"the rate did not converge on row {row.name}")


def _own(row: Sc21Row, rate: float) -> dict[str, Any]:
    graph = gpt_spec_profile(row.spec, A100_80GB, flops=rate)
    start = time.perf_counter()
    plan = plan_sync(graph, row.topology, SyncOptions(
        global_batch=row.batch, memory_bytes=MEMORY, training=_TRAINING, recompute=True))
    options = sorted({st.option.label or "-" for st in plan.stages})
    return {"layout": plan.layout, "schedule": plan.schedule.value, "options": options,
            "microbatch": plan.microbatch_size, "tflops": _tflops(row, plan),
            "memory": max(st.memory_bytes for st in plan.stages),
            "seconds": time.perf_counter() - start}


def _child(conn: Any, row: Sc21Row, rate: float) -> None:
    try:
        conn.send(_own(row, rate))
    except Exception as err:
        conn.send({"error": f"{type(err).__name__}: {err}"})


def own_plan(row: Sc21Row, rate: float, limit_s: float) -> dict[str, Any]:
    """The planner's plan of ``row`` under 80 GB, searched in a child process stopped
    after ``limit_s`` seconds (then ``{"timeout": limit_s}``)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, row, rate))
    proc.start()
    found: dict[str, Any] = {"timeout": limit_s}
    if parent.poll(limit_s):
        found = parent.recv()
    proc.terminate()
    proc.join()
    return found


def _own_cells(p: Priced, own: dict[str, Any]) -> str:
    if "skipped" in own:
        return "not searched (`--no-own`) | | | |"
    if "timeout" in own:
        return f"not found in {own['timeout']:.0f} s | | | |"
    if "error" in own:
        return f"none: {own['error'][:60]} | | | |"
    return (f"`{own['layout']}` {own['schedule']}, b={own['microbatch']}, stages "
            f"{' '.join(own['options'])} | "
            f"{own['tflops']:.1f} | {own['tflops'] / p.tflops:.2f}x | "
            f"{own['memory'] / 1e9:.1f} GB |")


def _prediction_table(priced: Sequence[Priced]) -> list[str]:
    lines = ["| model | GPUs | batch | layout (b) | published TFLOP/s | predicted | ratio "
             "| bubble | Megatron FLOPs at the fitted rate | the rest | of it, cuts "
             "| unequal stages | chunks summed per worker | memory / GPU | price s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in priced:
        r, plan = p.row, p.plan
        worker = "-" if p.per_worker is None else f"{p.per_worker:.3f}"
        lines.append(
            f"| {r.label} | {r.gpus} | {r.batch} | `{p.plan.layout}` ({r.microbatch}) | "
            f"{r.tflops:.0f} | {p.tflops:.1f} | {p.ratio:.3f} | "
            f"{100 * plan.bubble_fraction:.1f}% | {100 * p.matmul_share:.1f}% | "
            f"{100 * (1 - p.matmul_share - plan.bubble_fraction):.1f}% | "
            f"{100 * p.cut_share:.1f}% | {100 * p.imbalance:.1f}% | {worker} | "
            f"{p.memory / 1e9:.1f} GB{'' if p.fits else ' (over)'} | {p.seconds:.2f} |")
    return lines


def render_tables(priced: Sequence[Priced], own: Sequence[dict[str, Any]]) -> str:
    """The prediction table and the planner's table; the time columns come last."""
    lines = _prediction_table(priced)
    lines += ["", "| model | planner's layout under 80 GB | TFLOP/s | speed-up "
              "| memory / GPU | plan s |", "|---|---|---|---|---|---|"]
    for p, o in zip(priced, own, strict=True):
        seconds = f"{o['seconds']:.1f}" if "seconds" in o else "-"
        lines.append(f"| {p.row.label} | {_own_cells(p, o)} {seconds} |")
    return "\n".join(lines)


def findings(priced: Sequence[Priced]) -> list[str]:
    """Each row further than 15% from its published figure, with its priced shares and
    the matrix-product rate it would need, the other terms as priced."""
    out = []
    for p in priced:
        if abs(p.ratio - 1) <= _MISS:
            continue
        need = p.rate / p.ratio
        worker = "" if p.per_worker is None else \
            f"; with chunks summed per worker {p.per_worker:.2f}"
        published = p.plan.time_per_update_s * p.ratio
        out.append(
            f"- {p.row.label} (`{p.plan.layout}`, {p.plan.microbatches} microbatches of "
            f"{p.plan.microbatch_size}): {p.tflops:.1f} against {p.row.tflops:.0f} TFLOP/s "
            f"({p.ratio:.2f}), an update in {p.plan.time_per_update_s:.1f} s against "
            f"{published:.1f} s; bubble {100 * p.plan.bubble_fraction:.1f}%, unequal stages "
            f"{100 * p.imbalance:.1f}%, the rest "
            f"{100 * (1 - p.matmul_share - p.plan.bubble_fraction):.1f}% (cuts "
            f"{100 * p.cut_share:.1f}%){worker}; the published "
            f"figure needs matrix products at {need / 1e12:.0f} TFLOP/s "
            f"({100 * need / A100_80GB.peak_flops:.0f}% of the peak) with these terms.")
    return out


def render_section(priced: Sequence[Priced], own: Sequence[dict[str, Any]], rate: float,
                   limit_s: float, table_2: Sequence[Priced] = ()) -> str:
    misses = findings([*priced, *table_2]) or ["- none: every row is within 15%."]
    second = "\n".join(_prediction_table(table_2)) if table_2 else "(not priced in this run)"
    return f"""This section is generated: `python benchmarks/megatron_sc21.py` wrote it.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC21, arXiv 2104.04473), Table 1: GPT models of
1.7B to 1T parameters, sequence 2048, vocabulary 51,200, mixed precision,
on servers of 8 A100-80GB (NVSwitch, 8 HDR InfiniBand links a server), and
the teraFLOP/s per GPU each achieved by Megatron-LM's count
(`96 B s l h^2 (1 + s/6h + V/16lh)`, recomputation included). Each row is
priced with its published layout: t, p, GPUs and batch from the table; the
microbatch size (b), the interleaving (`--num-layers-per-virtual-pipeline-stage`)
and `--recompute-method uniform` (every block recomputed) from Megatron-LM's
`examples/sc21/run_table_1.sh`. dreampipe prices it with
`plan_sync(..., SyncOptions(layout=..., microbatch_size=b))` on
`dgx-a100:N`, bf16 weights with Adam's state, the cuts chosen by the
program. `dreampipe plan gpt:... -t dgx-a100:N --global-batch B
--microbatch-size b --precision bf16 --optimizer adam --layout tT-pP-vV-rK`
prices the same layout the same way (the preset's A100 runs its products at
the fitted rate below); without `--microbatch-size` and `-r` the planner
chooses them, and may keep activations that Megatron-LM recomputed while
the count above still includes the recomputation.

**One figure is fitted**: the sustained rate of matrix products,
{rate / 1e12:.1f} TFLOP/s ({100 * rate / A100_80GB.peak_flops:.1f}% of the A100's 312), chosen so
that the 1.7B row (data parallel only, no tensor or pipeline term) prices at its
published 137. It is used unchanged for every other row, and it is the
A100 preset's (`A100_SUSTAINED_FRACTION`; the test of this script re-fits it
and fails when the cost model moves it). Everything
else is the cost model's: what moves rather than multiplies (the softmax,
mask and dropout over the attention's scores, the bias-GELU, the
bias-dropout-add and LayerNorms) at the memory bandwidth, tensor collectives
over NVSwitch (a recomputed forward's again), pipeline cuts, the bubble, the
data-parallel all-reduce, recomputation, memory.
"Megatron FLOPs at the fitted rate" is the share of the update the model's
FLOPs take at that rate; "the rest" is what the bubble leaves: tensor
collectives, cuts, the all-reduce's tail, the bytes moved.

{render_tables(priced, own)}

The planner's own plan searches every layout (t, p, d, b, the schedule,
virtual stages, whole-stage recomputation) under 80 GB, with the same fitted
rate; a search still running after {limit_s:.0f} s is stopped and so
marked (planning speed is the subject of its own work). Its TFLOP/s use the
same count (recomputation included whether or not the plan recomputes), so
"speed-up" is the published layout's time over the plan's, both priced by
dreampipe. Its stages: `-` keeps the activations, `r` recomputes the whole
stage, `rK` its first K blocks, `tN` splits it N ways.

Table 2 of the same paper: PTD-P against ZeRO-3 without model parallelism
(DeepSpeed's, every GPU a replica of the whole model, `z3`), the global batch
fixed as the GPUs grow. Its figures are the paper's table, checked against its
text (section 5.2: PTD-P 6% and 24% above ZeRO-3 with the fewest GPUs, 70%
at twice as many) and the table's own training days (Eq. 4). The paper gives no
run script for it: PTD-P's interleaving is that of Megatron-LM's scripts for
the same model and layout (`run_figure_12.sh`, 174.6B on t8-p12: 2 blocks a
chunk; `run_table_1.sh`, 529.6B on t8-p35: 1 block a chunk), microbatches of 1.

{second}

Rows further than 15% from the published figure (computed):

{chr(10).join(misses)}
{_WHY}"""


_WHY = """
Where they miss, the terms (the evidence is in the columns above):

- **Interleaving's largest chunk.** The objective charges an interleaved
  pipeline `v m + p - 1` times its largest chunk, the one holding the head
  or the embedding ("unequal stages"), while a worker runs that chunk once
  in `v`: its other chunks are lighter. "Chunks summed per worker" is the
  ratio each interleaved row reaches when every worker is charged the sum of
  its chunks, `m max_w sum (tau + cut) + (p - 1) max (tau + cut)`. The
  program's min-max over chunks cannot express a worker's sum exactly, so
  the rule stays, an upper bound on the time.
- **One rate for every matrix product.** The rows without interleaving
  that miss need their products faster than the 1.7B row's, with every
  other term as priced. Megatron-LM's paper says so of its Table 1: "GPU
  utilization improves as the models get larger (larger matrix
  multiplications)" (section 5.1); one fitted figure, shape-blind, cannot
  carry that.
- **ZeRO-3 at scale.** With the batch fixed, ZeRO-3's published update
  takes as long on twice the GPUs (the updates above), although each GPU's
  work halves: DeepSpeed's gathers of the weights ran at a fraction of the
  links. dreampipe prices ZeRO-3 as its own runtime runs it, each use's
  gather of a stage's weights at the hierarchical all-reduce's rate over
  NVSwitch and each server's InfiniBand, so it predicts these rows faster
  than published and faster than PTD-P. It matches where the GPUs are
  fewest (the batch of 4 a GPU hides the gathers), as the paper's 6% and
  24% do.

Memory: the rows without interleaving are priced under 80 GB, the cuts
chosen by the program among those that fit ("(over)" where none fits). An
interleaved chunk is held to `80 GB / v` with every microbatch its worker
holds (a bound that the published runs beat), so interleaved rows are priced
without a limit, and their memory column is the bound on the cuts chosen,
not the run's ("(over)": above `80 GB / v`).
"""


def write(text: str, path: Path) -> None:
    """Set the section's block in ``path``, adding the heading and markers when absent."""
    page = path.read_text() if path.is_file() else ""
    if f"<!-- begin {_BLOCK} -->" not in page:
        page = (page.rstrip() + "\n\n" if page else "") + \
            f"{HEADING}\n\n<!-- begin {_BLOCK} -->\n<!-- end {_BLOCK} -->\n"
    path.write_text(replace_block(page, _BLOCK, text))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="\n\n".join((__doc__ or "").split("\n\n")[:2]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="", metavar="NAMES",
                        help="comma-separated Table 1 rows, e.g. 1.7B,18.4B (default: all, "
                             "and Table 2; writes nothing unless all)")
    parser.add_argument("--search-limit", type=float, default=90.0, metavar="S",
                        help="stop the planner's own search after S seconds (default 90)")
    parser.add_argument("--no-own", action="store_true",
                        help="skip the planner's own search (writes nothing)")
    parser.add_argument("--out", type=Path, default=_DEFAULT_OUT, metavar="PATH")
    parser.add_argument("--no-write", action="store_true", help="only print")
    args = parser.parse_args(argv)
    wanted = [r for r in ROWS if not args.rows or r.name in args.rows.split(",")]
    rate = fit_rate()
    print(f"fitted rate of matrix products: {rate / 1e12:.2f} TFLOP/s", flush=True)
    priced, own = [], []
    for row in wanted:
        priced.append(price(row, rate))
        own.append({"skipped": True} if args.no_own else
                   own_plan(row, rate, args.search_limit))
        print(f"{row.label}: {priced[-1].tflops:.1f} against {row.tflops:.0f}", flush=True)
    second = []
    for row in () if args.rows else TABLE_2:
        second.append(price(row, rate))
        print(f"{row.label}: {second[-1].tflops:.1f} against {row.tflops:.0f}", flush=True)
    text = render_section(priced, own, rate, args.search_limit, second)
    print(text)
    if not args.no_write and not args.rows and not args.no_own:
        write(text, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_objective import PipelineKind
from dreampipe.planning.sync_plan import SyncPlan
from dreampipe.planning.sync_search import plan_sync
from dreampipe.profiling.devices import A100_80GB
from dreampipe.profiling.gpt_shapes import attention_products_ms, blocks_recomputed
from dreampipe.profiling.gpt_spec import gpt_spec_profile
from dreampipe.profiling.graph import LayerGraph
from dreampipe.simulation.sync_copy import simulate_copy

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


@dataclass(frozen=True)
class Priced:
    """A row's published layout as dreampipe prices it, matrix products at ``rate``."""

    row: Sc21Row
    plan: SyncPlan
    rate: float
    seconds: float
    #: One copy of the pipeline simulated (:func:`simulate_copy`): the prediction.
    simulated_s: float
    graph: LayerGraph

    @property
    def tflops(self) -> float:
        rate = self.plan.tflops_per_gpu(self.graph, self.simulated_s)
        assert rate is not None  # a profile by shape
        return rate

    @property
    def bound(self) -> float:
        """The objective's closed form, a bound on the simulated time, as a ratio to the
        published figure."""
        return self.ratio * self.simulated_s / self.plan.time_per_update_s

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
            / self.simulated_s

    @property
    def bubble(self) -> float:
        """The update's time beyond every worker's own chunks, ``m`` microbatches each
        (the busiest worker's), over the update."""
        p = self.plan
        sums = [sum(st.tau_s + st.cut_s for st in p.stages[w::p.pipeline])
                for w in range(p.pipeline)]
        return max(0.0, 1.0 - p.microbatches * max(sums) / self.simulated_s)

    @property
    def memory(self) -> float:
        """The most a worker holds: its chunks' together (each at its own peak, a bound)."""
        p = self.plan
        return max(sum(st.memory_bytes for st in p.stages[w::p.pipeline])
                   for w in range(p.pipeline))

    @property
    def fits(self) -> bool:
        return self.memory <= MEMORY


def price(row: Sc21Row, rate: float) -> Priced:
    """``row``'s published layout, matrix products at ``rate`` FLOP/s, its cuts chosen to
    fit 80 GB as the run did (an interleaved chunk ``80 GB / v``); rows no cuts fit
    without the limit (:attr:`Priced.fits`); sharded only where the layout names a ZeRO
    level, as the runs were."""
    graph = gpt_spec_profile(row.spec, A100_80GB, flops=rate)
    kind = PipelineKind.INTERLEAVED if row.v > 1 else PipelineKind.FLUSH
    start = time.perf_counter()
    opts = SyncOptions(global_batch=row.batch, microbatch_size=row.microbatch,
                       training=_TRAINING, kinds=(kind,), layout=row.layout,
                       memory_bytes=MEMORY, whole_blocks=True,
                       zero_levels=None if row.layout.zero else (0,))
    try:
        plan = plan_sync(graph, row.topology, opts)
    except PlanError:
        plan = plan_sync(graph, row.topology, replace(opts, memory_bytes=None))
    simulated = simulate_copy(plan)
    return Priced(row, plan, rate, time.perf_counter() - start, simulated, graph)


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
    priced = Priced(row, plan, rate, time.perf_counter() - start, simulate_copy(plan), graph)
    return {"layout": plan.layout, "schedule": plan.schedule.value, "options": options,
            "microbatch": plan.microbatch_size, "time": priced.simulated_s,
            "tflops": priced.tflops, "bubble": priced.bubble,
            "recomputed": blocks_recomputed(graph, plan.recomputed_layers),
            "memory": priced.memory, "seconds": priced.seconds}


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
            f"{own['tflops']:.1f} | {p.simulated_s / own['time']:.2f}x | "
            f"{own['memory'] / 1e9:.1f} GB |")


def differences(priced: Sequence[Priced], own: Sequence[dict[str, Any]]) -> list[str]:
    """Where the planner's own plan differs from the published layout, and the terms
    that make it faster under dreampipe's model."""
    out = []
    for p, o in zip(priced, own, strict=True):
        if "layout" not in o:
            continue
        again = blocks_recomputed(p.graph, p.plan.recomputed_layers)
        out.append(
            f"- {p.row.label}: `{o['layout']}` with microbatches of {o['microbatch']} "
            f"against `{p.plan.layout}` of {p.plan.microbatch_size}; it recomputes "
            f"{o['recomputed']:.0f} of {p.row.layers} blocks against {again:.0f}, its bubble "
            f"is {100 * o['bubble']:.1f}% against {100 * p.bubble:.1f}%, and it holds "
            f"{o['memory'] / 1e9:.1f} GB of 80: an update in {o['time']:.1f} s against "
            f"{p.simulated_s:.1f} s ({p.simulated_s / o['time']:.2f}x).")
    return out


def _prediction_table(priced: Sequence[Priced]) -> list[str]:
    lines = ["| model | GPUs | batch | layout (b) | published TFLOP/s | predicted | ratio "
             "| the objective's bound | bubble | Megatron FLOPs at the fitted rate "
             "| the rest | of it, cuts | memory / GPU | price s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in priced:
        r = p.row
        lines.append(
            f"| {r.label} | {r.gpus} | {r.batch} | `{p.plan.layout}` ({r.microbatch}) | "
            f"{r.tflops:.0f} | {p.tflops:.1f} | {p.ratio:.3f} | {p.bound:.3f} | "
            f"{100 * p.bubble:.1f}% | {100 * p.matmul_share:.1f}% | "
            f"{100 * (1 - p.matmul_share - p.bubble):.1f}% | "
            f"{100 * p.cut_share:.1f}% | "
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
        published = p.simulated_s * p.ratio
        out.append(
            f"- {p.row.label} (`{p.plan.layout}`, {p.plan.microbatches} microbatches of "
            f"{p.plan.microbatch_size}): {p.tflops:.1f} against {p.row.tflops:.0f} TFLOP/s "
            f"({p.ratio:.2f}), an update in {p.simulated_s:.1f} s against "
            f"{published:.1f} s; bubble {100 * p.bubble:.1f}%, the rest "
            f"{100 * (1 - p.matmul_share - p.bubble):.1f}% (cuts "
            f"{100 * p.cut_share:.1f}%); the published "
            f"figure needs matrix products at {need / 1e12:.0f} TFLOP/s "
            f"({100 * need / A100_80GB.peak_flops:.0f}% of the peak) with these terms.")
    return out


def _attention_waits(rate: float, head: int, seq: int = 2048) -> float:
    """How many times its work's time attention's batched products take over one head
    ``head`` wide at ``rate``, as the profile prices them (its roofline)."""
    took, _ = attention_products_ms(seq, 1, head, 1, rate, A100_80GB.sustained_bandwidth(rate))
    return took / (4 * seq * seq * head / rate * 1e3)


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
`plan_sync(..., SyncOptions(layout=..., microbatch_size=b, zero_levels=(0,)))` on
`dgx-a100:N`, bf16 weights with Adam's state, each stage (chunk) holding
the same number of whole blocks as Megatron-LM places them (`whole_blocks`,
`--whole-blocks`), and the update's time is one copy of the pipeline simulated action by
action from those terms (`dreampipe.simulation.sync_copy`), which the
objective's closed form bounds ("the objective's bound": its ratio). `dreampipe
plan gpt:... -t dgx-a100:N --global-batch B --microbatch-size b --precision
bf16 --optimizer adam --layout tT-pP-vV-z0-rK --whole-blocks` prices the same
layout the same way (unsharded, as the runs were; the preset's A100 runs at the
fitted share below); without `--microbatch-size`, `-v`, `-z`, `-r` and
`--whole-blocks` the planner chooses them. The count follows
what a plan runs: `72 B s l h^2 (1 + s/6h)` for the blocks, `24 B s h^2 (1 +
s/6h)` more for each recomputed block, `6 B s h V` for the head; a published
row recomputes every block, so its count is the paper's.

**One figure is fitted**: the share of the A100's peaks its kernels sustain,
{100 * rate / A100_80GB.peak_flops:.1f}%: matrix products at {rate / 1e12:.1f} TFLOP/s of the
312, and what moves rather than multiplies (the softmax, mask and dropout
over the attention's scores, the bias-GELU, the bias-dropout-add and
LayerNorms) at the same share of its 2,039 GB/s, chosen so that the 1.7B row
(data parallel only, no tensor or pipeline term) prices at its published
137. It is used unchanged for every other row, and it is the A100 preset's
(`A100_SUSTAINED_FRACTION`; the test of this script re-fits it and fails
when the cost model moves it). One share for both peaks, not a peak
bandwidth beside a fitted product rate: the framework's kernels fall short
of both alike, and a full-bandwidth rule prices the small models' bytes, a
fifth of the 1.7B row's update, too cheaply, so the fit pushes the products'
rate down and every larger model (whose bytes weigh less) below its
published figure. A product waits on memory where its 16-bit operands take
longer at that bandwidth than its work at that rate (the roofline): the
weights' products never do here, attention's batched products always do, the
more the narrower the heads ({_attention_waits(rate, 96):.2f} times their work's time over heads of
96, the 1.7B row's; {_attention_waits(rate, 160):.2f} over 160, the 1008B row's). Priced as
work alone, the narrow heads' wait would be fitted into the products' rate,
slowing every wider model's products to match. Everything
else is the cost model's: tensor collectives
over NVSwitch (a recomputed forward's again), pipeline cuts, the bubble, the
data-parallel all-reduce, recomputation, memory.
"Megatron FLOPs at the fitted rate" is the share of the update the model's
FLOPs take at that rate; "the rest" is what the bubble leaves: tensor
collectives, cuts, the all-reduce's tail, the bytes moved (products waiting on
memory included).

{render_tables(priced, own)}

The planner's own plan searches every layout (t, p, d, b, the schedule,
virtual stages, whole-stage recomputation, each stage's ZeRO level) under
80 GB, with the same fitted
rate; a search still running after {limit_s:.0f} s is stopped and so
marked. Its TFLOP/s count the blocks it recomputes, as above, so a plan that
keeps its activations does less work at a like rate; "speed-up" is the
published layout's simulated time over the plan's, both priced by dreampipe.
Its stages: `-` keeps the activations, `r` recomputes the whole stage, `rK`
its first K blocks, `tN` splits it N ways, `zN` shards it at ZeRO level N.
Where it differs from
Megatron-LM's choice (computed):

{chr(10).join(differences(priced, own)) or "- (not searched in this run)"}

Why, in the terms above: the planner recomputes only what 80 GB forces,
where Megatron-LM's runs recompute every block, a forward again of each,
whether or not its activations fit; it shards the optimizer's state and the
gradients over the replicas (ZeRO levels 1 and 2) where that frees the
memory to keep activations, which those runs did not; and it weighs tensor
ranks, stages and the microbatch by the same terms, trading tensor
collectives for pipeline stages and their bubble where those cost less. A
larger microbatch buys nothing under one rate for every product size, a term
the fit cannot see, so the planner's small microbatches are its model's
choice, not a measured one.

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

- **ZeRO-3 at scale.** With the batch fixed, ZeRO-3's published update
  takes as long on twice the GPUs (the updates above), although each GPU's
  work halves: DeepSpeed's gathers of the weights ran at a fraction of the
  links. dreampipe prices ZeRO-3 as its own runtime runs it, each use's
  gather of a stage's weights at the hierarchical all-reduce's rate over
  NVSwitch and each server's InfiniBand, so it predicts these rows faster
  than published and faster than PTD-P. The published updates fit
  `max(compute, about 67 s)` for the 174.6B model (180 s for the
  529.6B): about four passes of the 16-bit weights a GPU per update, moved
  at about 21 GB/s, one HDR link's rate rather than a server's eight
  (DeepSpeed's gathers went parameter by parameter over 384 to 2,240 ranks).
  That is DeepSpeed's implementation of the time, not a term of dreampipe's
  runtime, and no figure is fitted to it, so these rows stay misses.

Memory: each row is priced under 80 GB, the cuts chosen by the program among
those that fit, and without the limit where none fits ("(over)"). The column
is the most a GPU holds: under interleaving, its chunks together, each
holding the most microbatches it holds at once in Megatron-LM's order (a
bound on the worker's peak); the program holds each chunk to `80 GB / v`, so
an interleaved row whose chunks differ may be priced over the limit though
its GPUs' sums fit.
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

"""``dreampipe bench`` on every workload, its tables written into docs/benchmarks.md.

Runs the bench (:func:`dreampipe.commands.bench.run_bench`, what ``dreampipe
bench`` runs) on the mlp, the transformer and the llama (each workload's
default runs) and prints each table as
``dreampipe bench`` does. With ``--write-docs`` each table becomes its
section of docs/benchmarks.md, and the mlp's ratios, the bench's headline,
become the README's benchmark table (its ``bench`` block).

    python benchmarks/bench.py [--workload mlp] [--rounds 3] [--steps 20] [--write-docs]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import _docs

from dreampipe.commands.bench import BenchOptions, run_bench
from dreampipe.commands.bench_report import BenchReport, format_table
from dreampipe.commands.workloads import WorkloadKind

__all__ = ["headline", "main"]


def headline(report: BenchReport, command: str) -> str:
    """The README's table: every ratio of medians with its same-round range."""
    lines = [
        "| comparison | ratio of medians | same-round range | what it isolates |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| `{r.run} / {r.baseline}` | {r.value:.2f}x | {r.low:.2f}-{r.high:.2f} | "
              f"{r.about} |" for r in report.ratios()]
    return (f"{report.work.describe()}; {report.rounds} interleaved rounds of "
            f"{report.work.steps} timed updates (`{command}` on {_docs.host_line()}).\n\n"
            + "\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", nargs="+", choices=[k.value for k in WorkloadKind],
                        default=[k.value for k in WorkloadKind],
                        help="the workloads to run (default: all)")
    parser.add_argument("--steps", type=int, default=20, help="timed updates (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one run may take (default 300)")
    _docs.add_argument(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: run at least 1 round")
    for kind in map(WorkloadKind, args.workload):
        report = run_bench(BenchOptions(workload=kind, steps=args.steps, warmup=args.warmup,
                                        timeout_s=args.timeout, rounds=args.rounds,
                                        progress=sys.stderr.isatty()))
        table = format_table(report)
        print(table, flush=True)
        if not args.write_docs:
            continue
        command = (f"dreampipe bench --workload {kind.value} --steps {args.steps} "
                   f"--warmup {args.warmup} --rounds {args.rounds}")
        _docs.write_section(f"bench-{kind.value}", table, command,
                            note="Made by `python benchmarks/bench.py --write-docs`.")
        if kind is WorkloadKind.MLP:
            text = _docs.README.read_text()
            _docs.README.write_text(_docs.replace_block(text, "bench", headline(report, command)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

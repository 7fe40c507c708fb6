"""Time per update and peak memory per rank of the transformer under each memory option.

Trains the transformer (8 blocks of width 256) on 3 local workers, plan ``2-1`` (stage 0
replicated), Adam, ``1f1b-flush`` with 4 microbatches of minibatches of 32, once per
option and round, every run in fresh processes (``dreampipe train --json``), the
options' order rotated each round; then once more per option with ``--measure-memory``
(counting tensors slows a run, so the timed runs do not count). Prints, per option, the
median time per update with its spread (min-max over the rounds) and its ratio to the
baseline's median, and each rank's measured peak beside the prediction. The options:
bf16-mixed and bf16 against fp32 (fp16-mixed is left out: CPUs without fp16 arithmetic
emulate its GEMMs, many times slower), each ``--zero``
level against none, and each stage recomputing its first 1, 2 or all of its blocks
(``--recompute-blocks``) against none. The groups' baselines are one run a round.

    python benchmarks/memory_options.py [--rounds 3] [--steps 20] [--write-docs]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

import _docs
from memory_vs_predicted import train_report

__all__ = ["OPTIONS", "main"]

_BASE = ("transformer", "--model-arg", "layers=8", "--model-arg", "dim=256", "--workers", "3",
         "--config", "2-1", "--optimizer", "adam", "--schedule", "1f1b-flush",
         "--microbatches", "4", "--batch-size", "32")

#: (group, option, its flags): each group's first option is its baseline.
OPTIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("precision", "fp32", ()),
    ("precision", "bf16-mixed", ("--precision", "bf16-mixed")),
    ("precision", "bf16", ("--precision", "bf16")),
    ("zero", "none", ()),
    ("zero", "level 1", ("--zero", "1")),
    ("zero", "level 2", ("--zero", "2")),
    ("zero", "level 3", ("--zero", "3")),
    ("recompute", "none", ()),
    ("recompute", "first block", ("--recompute-blocks", "1")),
    ("recompute", "first 2 blocks", ("--recompute-blocks", "2")),
    ("recompute", "every block", ("--recompute-blocks", "8")),
)


def _spread(values: Sequence[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-" \
           f"{format(max(values), fmt)})"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each option (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="updates per run (default 20)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds each run may take (default 600)")
    _docs.add_argument(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: run at least 1 round")
    tee = _docs.capture(args)
    distinct = list(dict.fromkeys(flags for _, _, flags in OPTIONS))
    by_flags: dict[tuple[str, ...], list[dict[str, Any]]] = {f: [] for f in distinct}
    for r in range(args.rounds):
        shift = r % len(distinct)
        for flags in distinct[shift:] + distinct[:shift]:
            by_flags[flags].append(train_report((*_BASE, *flags), args.steps, args.timeout,
                                                measure=False))
    memory = {flags: train_report((*_BASE, *flags), args.steps, args.timeout)
              for flags in distinct}
    runs = {label: by_flags[flags] for _, label, flags in OPTIONS}
    peaks = {label: memory[flags] for _, label, flags in OPTIONS}
    print(f"{' '.join(_BASE)}, {args.steps} updates a run, {args.rounds} rounds; medians "
          "(min-max)\n")
    print(f"{'option':<24} {'ms/update':>22} {'ratio':>6}   peak MiB, ranks 0, 1, 2 "
          "(predicted)")
    base_ms = 0.0
    for group, label, _ in OPTIONS:
        ms = [1e3 * float(run["elapsed_s"]) / args.steps for run in runs[label]]
        if label == next(x for g, x, _ in OPTIONS if g == group):
            base_ms = statistics.median(ms)
        ranks = []
        for rank in range(3):
            row = next(m for m in peaks[label]["memory"] if m["rank"] == rank)
            ranks.append(f"{float(row['measured_bytes']) / 2**20:.1f} "
                         f"({float(row['predicted_bytes']) / 2**20:.1f})")
        print(f"{group + ': ' + label:<24} {_spread(ms, '.1f'):>22} "
              f"{statistics.median(ms) / base_ms:>5.2f}x   " + "; ".join(ranks))
    _docs.finish(tee, "memory-options", __file__, argv)


if __name__ == "__main__":
    main()

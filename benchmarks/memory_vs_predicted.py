"""Each rank's peak memory in ``dreampipe train`` against the planner's prediction.

Trains, every run in fresh processes, and prints for every rank the predicted bytes,
the measured peak above the rank's baseline (docs/memory.md) and their ratio, with
PASS when every ratio is within its tolerance of 1 (a quarter for the mlp and the
cnn, as ``tests/reliability/test_memory.py``; 15% for the transformer):

- the mlp (8 layers of 2048, minibatches of 64) and the cnn (hidden 2048, minibatches
  of 256) on 2 local workers, 2 stages each, under ``pipedream`` with and without
  weight stashing (``--no-stash``);
- the transformer on 3 workers (``2-1``, Adam) in each precision (``fp32``,
  ``bf16-mixed``, ``bf16``), under ``pipedream`` and ``1f1b-flush`` with 4
  microbatches, each stage recomputing none or its first block (``--recompute-blocks``).

With ``--repeats N`` each run is repeated and a row shows the median ratio and the
spread (least to most) of its ``N`` runs.

    python benchmarks/memory_vs_predicted.py [--steps 10] [--repeats 1] [--tolerance T]
        [--workloads mlp,cnn,transformer] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import _docs

from dreampipe.quantities import format_bytes

__all__ = ["RUNS", "Run", "main", "runs", "train_report"]


@dataclass(frozen=True)
class Run:
    """One ``dreampipe train`` of the table: its workload, the row's label, its flags and
    the largest ``|ratio - 1|`` that passes."""

    workload: str
    label: str
    flags: tuple[str, ...]
    tolerance: float = 0.15


_MLP = ("mlp", "--model-arg", "width=2048", "--model-arg", "layers=8", "--stages", "0,4",
        "--batch-size", "64", "--workers", "2", "--config", "straight")
_CNN = ("cnn", "--model-arg", "hidden=2048", "--stages", "0,2", "--batch-size", "256",
        "--workers", "2", "--config", "straight")
_TRANSFORMER = ("transformer", "--workers", "3", "--config", "2-1", "--optimizer", "adam")
_SCHEDULES = {"pipedream": ("--schedule", "pipedream"),
              "1f1b-flush/4": ("--schedule", "1f1b-flush", "--microbatches", "4")}


def runs() -> tuple[Run, ...]:
    """Every run of the table, in its order."""
    out = [Run(name, f"{name} stash {'on' if stash else 'off'}",
               flags if stash else (*flags, "--no-stash"), 0.25)  # tests/reliability's
           for name, flags in (("mlp", _MLP), ("cnn", _CNN)) for stash in (True, False)]
    for schedule, flags in _SCHEDULES.items():
        for precision in ("fp32", "bf16-mixed", "bf16"):
            for blocks in (0, 1):
                recompute = ("--recompute-blocks", "1") if blocks else ()
                out.append(Run("transformer", f"{schedule} {precision}"
                               + (" recompute 1" if blocks else ""),
                               (*_TRANSFORMER, *flags, "--precision", precision, *recompute)))
    return tuple(out)


RUNS = runs()


def train_report(args: tuple[str, ...], steps: int, timeout_s: float,
                 measure: bool = True) -> dict[str, Any]:
    """The report of one fresh ``dreampipe train --json`` with ``--measure-memory`` (its
    ``memory`` rows: each rank's measured and predicted bytes), or without (``measure``
    False: for timing, as counting tensors slows the run)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "dreampipe", "train", *args, "--steps", str(steps), "--json",
           "--no-progress", *(("--measure-memory",) if measure else ())]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def row_line(run: Run, ranks: Sequence[dict[str, float]]) -> tuple[str, float]:
    """One rank's line over its repeated runs (``ranks``: that rank's rows), and its
    median ratio's distance from 1."""
    ratios = sorted(float(r["ratio"]) for r in ranks)
    median = statistics.median(ratios)
    measured = statistics.median(float(r["measured_bytes"]) for r in ranks)
    spread = f" {ratios[0]:.2f}-{ratios[-1]:.2f}" if len(ratios) > 1 else ""
    first = ranks[0]
    return (f"{run.workload:<11} {run.label:<36} {int(first['rank']):>4} "
            f"{int(first['stage']):>5} {format_bytes(first['predicted_bytes']):>10} "
            f"{format_bytes(measured):>10} {median:>6.2f}{spread}", abs(median - 1))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="minibatches per run (default 10)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each configuration; rows show the median (default 1)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest |ratio - 1| that passes (default: 0.25 for the mlp "
                             "and the cnn, 0.15 for the transformer)")
    parser.add_argument("--workloads", default="mlp,cnn,transformer",
                        help="comma-separated workloads to run (default all)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds each run may take (default 600)")
    _docs.add_argument(parser)
    args = parser.parse_args(argv)
    chosen = set(args.workloads.split(","))
    tee = _docs.capture(args)
    print(f"{'workload':<11} {'run':<36} {'rank':>4} {'stage':>5} {'predicted':>10} "
          f"{'measured':>10} {'ratio':>6}")
    worst, failed = 0.0, 0
    for run in (r for r in RUNS if r.workload in chosen):
        rows = [train_report(run.flags, args.steps, args.timeout)["memory"]
                for _ in range(args.repeats)]
        for rank in range(len(rows[0])):
            line, off = row_line(run, [r[rank] for r in rows])
            worst = max(worst, off)
            failed += off > (run.tolerance if args.tolerance is None else args.tolerance)
            print(line, flush=True)
    verdict = "PASS" if not failed else f"FAIL ({failed} rows)"
    print(f"{verdict}: every ratio within {worst:.2f} of 1 (tolerance "
          f"{'0.25 mlp and cnn, 0.15 transformer' if args.tolerance is None else args.tolerance})")
    _docs.finish(tee, "memory-vs-predicted", __file__, argv)


if __name__ == "__main__":
    main()

"""Epochs to target against dp's, candidate by candidate, in the delayed-update model.

Runs :func:`staleness.simulate` over workloads, workers (2, 4, 8), schedules
(pipedream; 2bw, whose updates do not depend on the depth but for ``nesterov``'s
momentum, on 4 workers, and on 8 for chars, whose 8-worker model has 8 blocks), candidates
and seeds, ``--jobs`` runs at a time, appending one JSON line per run to
``--results`` (runs already there are skipped: an interrupted sweep resumes).
``--report`` prints the table: for each candidate, the epochs to the target
in each seed (``-``: not within the epochs run) and the mean held-out figure
after the last epoch, in bold where it meets the issue's bound (every seed
within 1.25 times dp's median epochs).

The targets: digits 97% accuracy and chars 2.34 (the study's); otherwise dp's
worst held-out figure over the seeds halfway through its epochs (chars with 8
blocks: after 4, as the study's), to 0.01.

    python benchmarks/staleness_sweep.py --workloads digits chars --seeds 0 1 2
    python benchmarks/staleness_sweep.py --report    # benchmarks/staleness_sweep.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["main", "report"]

sys.path.insert(0, str(Path(__file__).resolve().parent))
import staleness
import staleness_tasks as tasks

_RESULTS = Path(__file__).resolve().parent / "staleness_sweep.jsonl"
_STUDY_TARGETS = {("digits", 4): 0.97, ("chars", 4): 2.34}
_BOUND = 1.25
#: Epochs the sweep trains: enough to tell 1.25 times dp's epochs (chars: 4 -> 5).
_EPOCHS = {"digits": 10, "chars": 5, "mlp": 8, "gpt2": 6}


def _blocks(workload: str, workers: int) -> int:
    return 8 if workload == "chars" and workers >= 8 else 4


def _runs(workloads: list[str], workers: list[int], candidates: list[str], seeds: list[int],
          schedules: list[str]) -> list[dict[str, Any]]:
    runs = []
    for workload, seed in itertools.product(workloads, seeds):
        for blocks in sorted({_blocks(workload, n) for n in workers}):
            runs.append({"workload": workload, "schedule": "sync", "candidate": "none",
                         "workers": 8 if blocks == 8 else 2, "seed": seed})
        for n, schedule, candidate in itertools.product(workers, schedules, candidates):
            if schedule == "2bw" and n != 4 and _blocks(workload, n) == 4:
                continue
            runs.append({"workload": workload, "schedule": schedule, "candidate": candidate,
                         "workers": n, "seed": seed})
    return runs


def _key(run: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(run[k] for k in ("workload", "schedule", "candidate", "workers", "seed"))


def _one(run: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    figures = staleness.simulate(run["workload"], run["schedule"], run["workers"],
                                 run["candidate"], run["seed"],
                                 epochs=_EPOCHS[run["workload"]])
    return {**run, "figures": figures}


def _load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _reached(figures: list[float], target: float, higher: bool) -> int | None:
    for epoch, f in enumerate(figures[1:], 1):
        if (f >= target - 1e-9) if higher else (f <= target + 1e-9):
            return epoch
    return None


def report(rows: list[dict[str, Any]], candidates: list[str]) -> list[str]:
    """The table's lines: one per workload, workers and schedule, a column per candidate,
    each cell the epochs to target seed by seed and the mean last figure, in bold where
    every seed is within the bound."""
    by: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["workload"], _blocks(r["workload"], r["workers"]), r["workers"],
                       r["schedule"], r["candidate"]), []).append(r)
    lines = ["| workload (target) | workers | schedule | dp | " + " | ".join(candidates) + " |",
             "|---" * (4 + len(candidates)) + "|"]
    configs = sorted({key[:4] for key in by if key[3] != "sync"})
    for workload, blocks, workers, schedule in configs:
        sync = by.get((workload, blocks, 8 if blocks == 8 else 2, "sync", "none"), [])
        if not sync:
            continue
        higher = workload in ("digits", "mlp")
        target = _target(workload, blocks, sync, higher)
        dp = statistics.median(math.inf if e is None else e
                               for e in (_reached(r["figures"], target, higher) for r in sync))
        cells = [_cell(sync, target, higher, None)]
        cells += [_cell(by.get((workload, blocks, workers, schedule, c), []), target, higher,
                        _BOUND * dp) for c in candidates]
        lines.append(f"| {workload} ({target:g}) | {workers} | {schedule} | "
                     + " | ".join(cells) + " |")
    return lines


def _cell(group: list[dict[str, Any]], target: float, higher: bool, bound: float | None
          ) -> str:
    if not group:
        return ""
    group = sorted(group, key=lambda r: int(r["seed"]))
    epochs = [_reached(r["figures"], target, higher) for r in group]
    text = (",".join("-" if e is None else str(e) for e in epochs)
            + f" ({statistics.mean(r['figures'][-1] for r in group):.3f})")
    if bound is not None and all(e is not None and e <= bound for e in epochs):
        return f"**{text}**"
    return text


def _target(workload: str, blocks: int, sync: list[dict[str, Any]], higher: bool) -> float:
    if (workload, blocks) in _STUDY_TARGETS:
        return _STUDY_TARGETS[workload, blocks]
    half = 4 if workload == "chars" else (len(sync[0]["figures"]) - 1) // 2  # chars: the study's
    worst = [r["figures"][half] for r in sync]
    if higher:
        return math.floor(min(worst) * 100) / 100
    return math.ceil(max(worst) * 100) / 100


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(tasks.WORKLOADS),
                        choices=tasks.WORKLOADS)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=["pipedream", "2bw"])
    parser.add_argument("--candidates", nargs="+",
                        default=["none", "default", "nesterov", "error-feedback", "paci",
                                 "pipemare"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--results", type=Path, default=_RESULTS)
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args(argv)
    if args.report:
        print("\n".join(report(_load(args.results), args.candidates)))
        return
    done = {_key(r) for r in _load(args.results)}
    todo = [r for r in _runs(args.workloads, args.workers, args.candidates, args.seeds,
                             args.schedules) if _key(r) not in done]
    print(f"{len(todo)} runs", flush=True)
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool, \
            args.results.open("a") as out:
        for row in pool.imap_unordered(_one, todo):
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(" ".join(str(row[k]) for k in ("workload", "workers", "schedule",
                                                  "candidate", "seed")), ":",
                  " ".join(f"{f:.3f}" for f in row["figures"][1:]), flush=True)


if __name__ == "__main__":
    main()

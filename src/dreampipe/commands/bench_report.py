"""What ``dreampipe bench`` prints: medians over rounds with their spread, and the ratios.

Each ratio is of two runs' medians; its spread is the lowest and highest of
the ratios within one round (runs are interleaved, so a round's pair ran
close together in time). What each ratio sets apart: docs/training.md,
"The bench".
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from dreampipe.commands.workloads import Workload

__all__ = ["RATIOS", "BenchEntry", "BenchReport", "Ratio", "format_table"]

#: ``(run, baseline, what the ratio shows)``, in the order the table prints them.
RATIOS: tuple[tuple[str, str, str], ...] = (
    ("1f1b-flush", "torch-1f1b-stock", "as each ships (kernels and heap set-up)"),
    ("1f1b-flush", "torch-1f1b", "same process set-up"),
    ("1f1b-flush-unfused", "torch-1f1b", "same kernels, same set-up"),
    ("pipedream", "ddp", "the paper's pairing: DDP, batch/2 per worker"),
    ("ddp-no-allreduce", "ddp", "DDP's compute alone (not training) over DDP"),
    ("pipedream", "torch-1f1b-big", "torch 1F1B, microbatches of pipedream's size"),
    ("pipedream", "torch-1f1b", "not like for like: microbatch sizes differ"),
    ("gpipe", "torch-gpipe", "same schedule"),
    ("zb-h1", "torch-zb", "zero bubble, same stages and microbatches"),
    ("interleaved-1f1b", "torch-interleaved-1f1b", "2 stages per worker, same cut"),
    ("zbv", "torch-zbv", "V-shaped zero bubble, same 4 chunks in the V"),
    ("dualpipev", "torch-dualpipev", "DualPipeV, same 4 chunks in the V"),
    ("2bw", "1f1b-flush", "same microbatches, no flush (PyTorch ships no 2BW)"),
)


@dataclass(frozen=True)
class BenchEntry:
    """One run: samples/s of each round, its microbatch size, the simulator's prediction if any."""

    name: str
    rounds: tuple[float, ...]
    microbatch_size: int
    predicted_samples_per_s: float | None = None

    @property
    def samples_per_s(self) -> float:
        """The median over rounds."""
        return statistics.median(self.rounds)


@dataclass(frozen=True)
class Ratio:
    """``run / baseline`` of medians, with the lowest and highest same-round ratio."""

    run: str
    baseline: str
    about: str
    value: float
    low: float
    high: float

    @property
    def key(self) -> str:
        return f"{self.run}/{self.baseline}"


@dataclass(frozen=True)
class BenchReport:
    """Every run's rounds, with the workload and rounds they ran under."""

    entries: tuple[BenchEntry, ...]
    work: Workload

    def get(self, name: str) -> BenchEntry | None:
        """The entry of run ``name``, None if it did not run."""
        return next((e for e in self.entries if e.name == name), None)

    def ratios(self) -> list[Ratio]:
        """The ratios of :data:`RATIOS` whose two runs both ran."""
        out = []
        for run, base, about in RATIOS:
            a, b = self.get(run), self.get(base)
            if a is None or b is None or b.samples_per_s <= 0:
                continue
            paired = [x / y for x, y in zip(a.rounds, b.rounds, strict=True) if y > 0]
            out.append(Ratio(run, base, about, a.samples_per_s / b.samples_per_s,
                             min(paired), max(paired)))
        return out

    @property
    def rounds(self) -> int:
        return max((len(e.rounds) for e in self.entries), default=0)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object."""
        results: dict[str, dict[str, Any]] = {}
        for e in self.entries:
            results[e.name] = {"samples_per_s": e.samples_per_s, "min": min(e.rounds),
                               "max": max(e.rounds), "rounds": list(e.rounds),
                               "microbatch_size": e.microbatch_size}
            if e.predicted_samples_per_s is not None:
                results[e.name]["predicted_samples_per_s"] = e.predicted_samples_per_s
        ratios = self.ratios()
        return {
            "workload": self.work.kind.value,
            "results": results,
            "ratios": {r.key: r.value for r in ratios},
            "ratio_ranges": {r.key: [r.low, r.high] for r in ratios},
            "steps": self.work.steps,
            "warmup": self.work.warmup,
            "rounds": self.rounds,
        }


def format_table(report: BenchReport) -> str:
    """Runs (median, min-max, prediction), then the ratios with their spread."""
    work = report.work
    wide = max([19, *(len(e.name) for e in report.entries)])
    ratios = report.ratios()
    names = [f"{r.run} / {r.baseline}" for r in ratios]
    wide_ratio = max([34, *(len(n) for n in names)])
    lines = [
        work.describe(),
        f"{work.steps} timed updates after {work.warmup} warm-up, wall clock between barriers "
        f"on all ranks; median and min-max of {report.rounds} interleaved rounds; "
        "microbatch: samples per forward/backward",
        f"{'run':<{wide}} {'microbatch':>10} {'samples/s':>10} {'min-max':>15} {'predicted':>10} "
        f"{'meas/pred':>9}",
    ]
    for e in report.entries:
        pred = e.predicted_samples_per_s
        spread = f"{min(e.rounds):.0f}-{max(e.rounds):.0f}"
        pred_s = f"{pred:10.1f}" if pred else f"{'':>10}"
        meas = f"{e.samples_per_s / pred:9.2f}" if pred else f"{'':>9}"
        lines.append(f"{e.name:<{wide}} {e.microbatch_size:>10} {e.samples_per_s:10.1f} "
                     f"{spread:>15} "
                     f"{pred_s} {meas}".rstrip())
    if ratios:
        lines.append("ratios of medians (min-max of the same-round ratios):")
    for r, name in zip(ratios, names, strict=True):
        lines.append(f"  {name:<{wide_ratio}} {r.value:.2f}x ({r.low:.2f}-{r.high:.2f})  {r.about}")
    return "\n".join(lines)

"""The convergence study's table and plots, from its results JSON (``convergence.py --report``).

The table goes into ``convergence.md`` between two markers, so the prose
around it is kept; the plots are ``convergence-<workload>.png``. Targets:
97% held-out accuracy on the digits; on every other workload, the held-out
figure that every dp run reaches halfway through its epochs (the worst of
theirs then, rounded to 0.01 toward the easier side).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BEGIN", "DIGITS_TARGET", "END", "ROWS_MODULE", "study_rows", "table", "targets",
           "write", "write_rows"]

BEGIN = "<!-- table: written by `python benchmarks/convergence.py --report` -->"
END = "<!-- end of the written table -->"
DIGITS_TARGET = 0.97
#: The package's copy of the study's epochs to target (``semantics="any"`` reads it).
ROWS_MODULE = Path(__file__).resolve().parents[1] / "src/dreampipe/runplan/study_epochs.py"
_ROWS_BEGIN = "# begin: written by `python benchmarks/convergence.py --report`\n"
_ROWS_END = "# end\n"
#: The asynchronous schedules' variants whose rows the planner reads: the defaults.
_WEIGHED = ("pipedream", "2bw")


@dataclass(frozen=True)
class _Metric:
    key: str
    label: str
    higher_is_better: bool

    def meets(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target


@dataclass(frozen=True)
class _Workload:
    """How a workload is scored and shown, and its optimizer family, which the planner's
    rows carry (``study_epochs.StudyRow``: ``"sgd"`` or ``"adam"``)."""

    metric: _Metric
    title: str
    family: str


_LOSS = _Metric("test_loss", "held-out loss (nats per character)", False)
_ACCURACY = _Metric("test_accuracy", "held-out accuracy", True)
#: Every workload the study may hold, in the table's order.
_WORKLOADS = {
    "digits": _Workload(_ACCURACY, "Digits CNN", "sgd"),
    "chars": _Workload(_LOSS, "Character transformer", "adam"),
    "chars8": _Workload(_LOSS, "Character transformer, 8 blocks", "adam"),
    "mlp": _Workload(_ACCURACY, "Deep MLP (SGD)", "sgd"),
    "gpt2": _Workload(_LOSS, "Hugging Face GPT-2, tied embeddings", "adam"),
}
_METRICS = {name: w.metric for name, w in _WORKLOADS.items()}


def _groups(data: dict[str, Any]) -> Iterator[tuple[str, int, str, list[dict[str, Any]]]]:
    """(workload, workers, variant, runs over seeds): workloads in :data:`_METRICS`'
    order, then workers, then the study's variants' order."""
    study, runs = data["study"], data["runs"].values()
    order = list(dict.fromkeys(v for g in study["groups"] for v in g["variants"]))
    for workload in _METRICS:
        for workers in sorted({g["workers"] for g in study["groups"]
                               if workload in g["workloads"]}):
            for variant in order:
                found = [r for r in runs if (r["workload"], r["workers"], r["variant"])
                         == (workload, workers, variant)]
                if found:
                    yield workload, workers, variant, sorted(found, key=lambda r: r["seed"])


def targets(data: dict[str, Any]) -> dict[str, float]:
    """Each workload's target; all but the digits' only once dp runs are in: dp's worst
    held-out figure halfway through the workload's epochs, so that a schedule that needs
    more epochs than dp can show how many (as dp reaches 97% on the digits well before
    their end)."""
    out = {"digits": DIGITS_TARGET}
    for workload, metric in _METRICS.items():
        if workload == "digits" or workload not in data["study"]["epochs"]:
            continue
        half = data["study"]["epochs"][workload] // 2
        dp = [r[metric.key][half] for r in data["runs"].values()
              if r["workload"] == workload and r["variant"] == "dp"]
        # rounded toward the easier side, so a schedule equal to dp but for float
        # rounding reaches it too
        if dp and metric.higher_is_better:
            out[workload] = math.floor(min(dp) * 100) / 100
        elif dp:
            out[workload] = math.ceil(max(dp) * 100) / 100
    return out


def _to_target(run: dict[str, Any], metric: _Metric, target: float) -> tuple[float, float]:
    """Epochs and training seconds to the first evaluation at the target (inf: never)."""
    for epoch, value in enumerate(run[metric.key]):
        if value is not None and metric.meets(value, target):
            return float(epoch), float(run["seconds"][epoch])
    return math.inf, math.inf


def study_rows(data: dict[str, Any]) -> str:
    """The Python text of ``study_epochs.ROWS``: per workload, workers and asynchronous
    schedule, the median epochs to target over the seeds (inf when some seed never reached
    it) and dp's median."""
    goal = targets(data)
    epochs: dict[tuple[str, int, str], tuple[float, int]] = {}
    for workload, workers, variant, runs in _groups(data):
        if workload in goal and variant in (*_WEIGHED, "dp"):
            reach = [_to_target(r, _METRICS[workload], goal[workload])[0] for r in runs]
            median = math.inf if any(map(math.isinf, reach)) else statistics.median(reach)
            epochs[workload, workers, variant] = median, len(runs)
    lines = []
    for (workload, workers, variant), (mine, seeds) in epochs.items():
        dp = epochs.get((workload, workers, "dp"))
        if variant != "dp" and dp is not None:
            shown = "math.inf" if math.isinf(mine) else repr(float(mine))
            lines.append(f'    StudyRow("{workload}", {workers}, "{variant}", {shown}, '
                         f'{float(dp[0])!r}, {seeds}, "{_WORKLOADS[workload].family}"),\n')
    return "ROWS: tuple[StudyRow, ...] = (\n" + "".join(lines) + ")\n"


def write_rows(data: dict[str, Any], module: Path = ROWS_MODULE) -> Path:
    """Put :func:`study_rows` between the markers of ``module``; the path."""
    text = module.read_text()
    if _ROWS_BEGIN not in text or _ROWS_END not in text:
        raise SystemExit(f"{module} has lost its markers; put back {_ROWS_BEGIN!r} and "
                         f"{_ROWS_END!r}")
    head, rest = text.split(_ROWS_BEGIN, 1)
    module.write_text(f"{head}{_ROWS_BEGIN}{study_rows(data)}{_ROWS_END}"
                      f"{rest.split(_ROWS_END, 1)[1]}")
    return module


def _fmt(value: float, unit: str = "") -> str:
    return "not reached" if math.isinf(value) else f"{value:.3g}{unit}"


def table(data: dict[str, Any]) -> str:
    """The markdown table: final figure, seeds at target, epochs and seconds to it, / dp."""
    goal = targets(data)
    lines = ["| workload | workers | schedule | final (mean ± std) | s per epoch | seeds at "
             "target | epochs to target | seconds to target | time to target / dp's |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    medians: dict[tuple[str, int, str], float] = {}
    rows = []
    for workload, workers, variant, runs in _groups(data):
        metric = _METRICS[workload]
        finals = [r[metric.key][-1] for r in runs]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        per_epoch = statistics.median(r["seconds"][-1] / (len(r["seconds"]) - 1) for r in runs)
        reach = [_to_target(r, metric, goal[workload]) for r in runs] if workload in goal else []
        epochs = statistics.median(e for e, _ in reach) if reach else math.inf
        seconds = statistics.median(s for _, s in reach) if reach else math.inf
        medians[workload, workers, variant] = seconds
        hits = sum(not math.isinf(e) for e, _ in reach)
        rows.append((workload, workers, variant, (
            f"| {workload} | {workers} | {variant} | {statistics.fmean(finals):.3f} ± "
            f"{spread:.3f} | {per_epoch:.2f} | {hits}/{len(runs)} | {_fmt(epochs)} | "
            f"{_fmt(seconds)} |")))
    for workload, workers, variant, row in rows:
        dp = medians.get((workload, workers, "dp"), math.inf)
        mine = medians[workload, workers, variant]
        ratio = "-" if math.isinf(mine) or math.isinf(dp) else f"{mine / dp:.2f}"
        lines.append(f"{row} {ratio} |")
    said = ", ".join(f"{w}: {_METRICS[w].label} {'≥' if _METRICS[w].higher_is_better else '≤'}"
                     f" {t:.4g}" for w, t in goal.items())
    halves = ", ".join(f"{w} after {n // 2} of {n}" for w, n in data["study"]["epochs"].items()
                       if w != "digits" and w in goal)
    lines += ["", f"Targets: {said}. Epochs and seconds to target are medians over the "
              "seeds, a seed that never reaches it counting as never; seconds are training "
              "time only (evaluation left out). A target other than the digits' is dp's "
              f"worst figure over the seeds halfway through the epochs ({halves})."]
    return "\n".join(lines)


def _plot(data: dict[str, Any], workload: str, path: Path) -> None:
    """Rows: workers; columns: against epochs and against seconds; shade: min-max of seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metric, goal = _METRICS[workload], targets(data).get(workload)
    workers = sorted({n for wl, n, _, _ in _groups(data) if wl == workload})
    fig, axes = plt.subplots(len(workers), 2, figsize=(11, 4 * len(workers)), squeeze=False)
    variants = dict.fromkeys(v for g in data["study"]["groups"] for v in g["variants"])
    colours = {v: f"C{i}" for i, v in enumerate(variants)}
    trained = [x for wl, _, _, runs in _groups(data) if wl == workload
               for r in runs for x in r[metric.key][1:]]
    margin = 0.05 * (max(trained) - min(trained)) + 1e-3
    ylim = (min(trained) - margin, max(trained) + margin)  # epoch 0 may lie outside
    for w, variant_runs in ((w, [(v, r) for wl, n, v, r in _groups(data)
                                 if (wl, n) == (workload, w)]) for w in workers):
        row = axes[workers.index(w)]
        for variant, runs in variant_runs:
            epochs = min(len(r[metric.key]) for r in runs)
            values = [[r[metric.key][e] for r in runs] for e in range(epochs)]
            mean = [statistics.fmean(v) for v in values]
            low, high = [min(v) for v in values], [max(v) for v in values]
            seconds = [statistics.fmean(r["seconds"][e] for r in runs) for e in range(epochs)]
            for ax, x in ((row[0], list(range(epochs))), (row[1], seconds)):
                ax.plot(x, mean, color=colours[variant], label=variant, marker=".")
                ax.fill_between(x, low, high, color=colours[variant], alpha=0.2)
        row[0].xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax, xlabel in ((row[0], "epoch"), (row[1], "training seconds (mean over seeds)")):
            if goal is not None:
                ax.axhline(goal, color="grey", linestyle="--", linewidth=1, label="target")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(metric.label)
            ax.set_ylim(*ylim)
            ax.set_title(f"{_WORKLOADS[workload].title}, {w} workers")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(data: dict[str, Any], docs: Path) -> list[Path]:
    """The plots and the table in ``docs/convergence.md`` (made if missing); what it wrote."""
    docs.mkdir(parents=True, exist_ok=True)
    written = []
    for workload in _METRICS:
        if any(r["workload"] == workload for r in data["runs"].values()):
            path = docs / f"convergence-{workload}.png"
            _plot(data, workload, path)
            written.append(path)
    doc = docs / "convergence.md"
    text = doc.read_text() if doc.exists() else f"# Convergence\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has lost its table markers; put back {BEGIN!r} and {END!r}")
    head, rest = text.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{table(data)}\n{END}{rest.split(END, 1)[1]}")
    return [*written, doc]

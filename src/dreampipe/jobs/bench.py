"""``dreampipe bench``: dreampipe's schedules against PyTorch's own, on one workload.

The workload is fixed so that runs compare: the zoo ``mlp`` (8 layers of
1024), cut into 2 stages of 4 layers, one thread per worker, 256 samples per
weight update as 8 microbatches of 32. dreampipe runs it under
``1f1b-flush`` and ``gpipe``, and under ``pipedream`` with minibatches of 128
and one update each (the PipeDream paper pairs a PipeDream minibatch with
data parallelism's per-worker minibatch, here 256 / 2 workers). The
baselines (:mod:`dreampipe.jobs.baselines`) are ``torch.distributed.pipelining``'s
``Schedule1F1B`` and ``ScheduleGPipe``, DDP on 2 workers, and one process
with 1 and with 2 threads.

Every run trains on the same number of samples after warm-up updates that
are not timed. For dreampipe's runs the timed window is read from the
measured events: from the end of the input stage's last warm-up backward to
the end of its last backward. The simulator's prediction for each of
dreampipe's schedules, from a profile of the mlp taken here with one
thread, is read over the same window of the simulated events.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from dreampipe.errors import DreampipeError
from dreampipe.jobs.baselines import Baseline, Workload, run_baseline
from dreampipe.jobs.local import profile_as_worker
from dreampipe.jobs.machine import local_costs, local_topology
from dreampipe.planning.plan import Plan
from dreampipe.runtime.launch import pinned_threads
from dreampipe.scheduling.actions import ActionKind, ScheduleKind
from dreampipe.scheduling.events import Event
from dreampipe.scheduling.units import UnitLayout

__all__ = [
    "BENCH_NAMES",
    "BenchEntry",
    "BenchOptions",
    "BenchReport",
    "format_table",
    "run_bench",
    "window_samples_per_s",
]

log = logging.getLogger(__name__)

_DREAMPIPE = {
    "pipedream": ScheduleKind.PIPEDREAM,
    "1f1b-flush": ScheduleKind.FLUSH,
    "gpipe": ScheduleKind.GPIPE,
}
#: Every run ``dreampipe bench`` knows, in the order it runs and prints them.
BENCH_NAMES: tuple[str, ...] = (*_DREAMPIPE, *(b.value for b in Baseline))
#: Timed repeats per layer in the bench's profile (more than the default: less noise).
_REPEATS = 25
#: Longest wait of a dreampipe rank for its peer; the whole run has ``--timeout``.
_PEER_TIMEOUT_S = 60.0
#: dreampipe's schedule beside the PyTorch schedule it is compared with.
_PAIRS = (("1f1b-flush", "torch-1f1b"), ("pipedream", "torch-1f1b"), ("gpipe", "torch-gpipe"))


@dataclass(frozen=True)
class BenchOptions:
    """Timed updates, warm-up updates, rounds and the per-run hard limit.

    Every run is repeated ``rounds`` times, interleaved (all runs once, then
    all again), and its median is reported, so that a burst of load on a
    shared machine does not decide a ratio.
    """

    steps: int = 20
    warmup: int = 3
    timeout_s: float = 300.0
    progress: bool = True
    pipedream_minibatch: int = 128
    rounds: int = 3

    def workload(self) -> Workload:
        """The bench workload at these options' steps and warm-up."""
        return Workload(steps=self.steps, warmup=self.warmup)


@dataclass(frozen=True)
class BenchEntry:
    """One run: measured samples/s, and the simulator's prediction for dreampipe's."""

    name: str
    samples_per_s: float
    predicted_samples_per_s: float | None = None


@dataclass(frozen=True)
class BenchReport:
    """Every bench run's median result, with the options they ran under."""

    entries: tuple[BenchEntry, ...]
    options: BenchOptions

    def get(self, name: str) -> BenchEntry | None:
        """The entry of run ``name``, None if it did not run."""
        return next((e for e in self.entries if e.name == name), None)

    def ratios(self) -> list[tuple[str, str, float]]:
        """``(dreampipe name, torch name, ratio of samples/s)`` for the pairs that ran."""
        out = []
        for ours, theirs in _PAIRS:
            a, b = self.get(ours), self.get(theirs)
            if a is not None and b is not None and b.samples_per_s > 0:
                out.append((ours, theirs, a.samples_per_s / b.samples_per_s))
        return out

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object."""
        results: dict[str, dict[str, float]] = {}
        for e in self.entries:
            results[e.name] = {"samples_per_s": e.samples_per_s}
            if e.predicted_samples_per_s is not None:
                results[e.name]["predicted_samples_per_s"] = e.predicted_samples_per_s
        return {
            "results": results,
            "ratios": {f"{a}/{b}": r for a, b, r in self.ratios()},
            "steps": self.options.steps,
            "warmup": self.options.warmup,
            "rounds": self.options.rounds,
        }


def window_samples_per_s(
    events: Sequence[Event], *, warmup_units: int, total_units: int, unit_samples: int
) -> float:
    """Samples/s between the input stage's last warm-up backward and its last backward.

    Units ``warmup_units..total_units-1`` finish their backward at stage 0
    inside that window; with no warm-up the window opens at the first event.
    """
    ends = {e.unit: e.end_s for e in events if e.stage == 0 and e.kind is ActionKind.BACKWARD}
    needed = [total_units - 1] + ([warmup_units - 1] if warmup_units else [])
    missing = [u for u in needed if u not in ends]
    if missing:
        raise DreampipeError(
            f"the events lack the input stage's backward of unit(s) {missing}; time a window "
            "on a run that recorded events for all its units"
        )
    start = ends[warmup_units - 1] if warmup_units else min(e.start_s for e in events)
    span = ends[total_units - 1] - start
    return (total_units - warmup_units) * unit_samples / span if span > 0 else 0.0


@dataclass(frozen=True)
class _Shape:
    """How a dreampipe schedule cuts the workload: its units, and updates timed and not."""

    layout: UnitLayout
    updates: int
    warmup_updates: int

    @property
    def warmup_units(self) -> int:
        return self.layout.num_units(self.warmup_updates)

    @property
    def total_units(self) -> int:
        return self.layout.num_units(self.warmup_updates + self.updates)


def _shape(name: str, opts: BenchOptions, work: Workload) -> _Shape:
    kind = _DREAMPIPE[name]
    if kind is ScheduleKind.PIPEDREAM:
        per = work.batch // opts.pipedream_minibatch
        layout = UnitLayout(kind=kind, minibatch_size=opts.pipedream_minibatch)
        return _Shape(layout, work.steps * per, work.warmup * per)
    layout = UnitLayout(kind=kind, minibatch_size=work.batch, microbatches=work.microbatches)
    return _Shape(layout, work.steps, work.warmup)


def _plan(work: Workload) -> Plan:
    return Plan.from_config(
        work.layers, list(work.stage_bounds), [1] * len(work.stage_bounds), model="mlp"
    )


def _model_kwargs(work: Workload) -> tuple[tuple[str, Any], ...]:
    return (("layers", work.layers), ("width", work.width))


def _run_dreampipe(shape: _Shape, work: Workload, timeout_s: float) -> float:
    from dreampipe.runtime import RunConfig, launch_local

    layout = shape.layout
    cfg = RunConfig(
        model="mlp", plan=_plan(work), schedule=layout.kind,
        minibatch_size=layout.unit_size * layout.units_per_update,
        microbatches=layout.microbatches,
        steps=shape.warmup_updates + shape.updates,
        lr=work.lr, seed=work.seed, timeout_s=min(timeout_s, _PEER_TIMEOUT_S),
        dataset="synthetic", model_kwargs=_model_kwargs(work), record_events=True,
        evaluate=False,
    )
    result = launch_local(cfg, workers=len(work.stage_bounds), deadline_s=timeout_s)
    return window_samples_per_s(
        result.events, warmup_units=shape.warmup_units, total_units=shape.total_units,
        unit_samples=layout.unit_size,
    )


def _update_seconds(work: Workload, stash: bool) -> tuple[float, ...]:
    """Per stage: one SGD step, plus (``stash``) the copy-on-write of the weights.

    PipeDream's stage keeps the old weights for units still in flight when it
    updates (DESIGN.md section 5), which costs one copy of its weights; the
    last stage never has a unit in flight at its step. Medians of a few
    timings here, one thread.
    """
    spec = work.spec()
    out = []
    with torch.random.fork_rng(devices=[]), pinned_threads(1):
        for s in range(len(work.stage_bounds)):
            params = list(spec.build(*work.stage_range(s), seed=work.seed).parameters())
            for p in params:
                p.grad = torch.zeros_like(p)
            opt = torch.optim.SGD(params, lr=work.lr)
            cost = _median_s(opt.step)
            if stash and s < len(work.stage_bounds) - 1:
                cost += _median_s(_copier(params))
            out.append(cost)
    return tuple(out)


def _copier(params: list[torch.nn.Parameter]) -> Callable[[], object]:
    return lambda: [p.detach().clone() for p in params]


def _median_s(fn: Callable[[], object], repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _predict(shapes: Sequence[_Shape], work: Workload) -> dict[ScheduleKind, float]:
    """Simulated samples/s per schedule, from a one-thread profile at each unit size.

    The layer profile gives each unit's forward and backward; the weight
    update after each minibatch is timed here too (:func:`_update_seconds`).
    """
    from dreampipe.planning import planner
    from dreampipe.simulation.simulator import simulate_schedule

    spec = work.spec()
    topology = local_topology(len(work.stage_bounds))
    graphs = {}
    out = {}
    for sh in shapes:
        layout = sh.layout
        if layout.unit_size not in graphs:
            graphs[layout.unit_size] = profile_as_worker(spec, layout.unit_size,
                                                         repeats=_REPEATS)
        graph = graphs[layout.unit_size]
        plan = planner.evaluate_plan(graph, topology, list(work.stage_bounds), [1, 1])
        sched = layout.build([1] * len(work.stage_bounds), sh.warmup_updates + sh.updates)
        costs = replace(local_costs(graph, plan, unit_fraction=1.0),
                        step_s=_update_seconds(work, layout.kind is ScheduleKind.PIPEDREAM))
        sim = simulate_schedule(sched, costs)
        out[layout.kind] = window_samples_per_s(
            sim.events, warmup_units=sh.warmup_units, total_units=sh.total_units,
            unit_samples=layout.unit_size,
        )
    return out


def run_bench(opts: BenchOptions, names: Sequence[str] | None = None) -> BenchReport:
    """Run the named runs (default: all of :data:`BENCH_NAMES`), each in fresh processes."""
    chosen = [n for n in BENCH_NAMES if names is None or n in names]
    unknown = sorted(set(names or ()) - set(BENCH_NAMES))
    if unknown:
        raise DreampipeError(f"unknown bench run(s) {unknown}; choose from {list(BENCH_NAMES)}")
    work = opts.workload()
    shapes = {n: _shape(n, opts, work) for n in chosen if n in _DREAMPIPE}
    predicted = _predict(list(shapes.values()), work) if shapes else {}
    rates: dict[str, list[float]] = {name: [] for name in chosen}
    for name in _progress(chosen * opts.rounds, opts.progress):
        if name in shapes:
            rate = _run_dreampipe(shapes[name], work, opts.timeout_s)
        else:
            rate = run_baseline(Baseline(name), work, timeout_s=opts.timeout_s)
        rates[name].append(rate)
        log.info("bench %s: %.1f samples/s", name, rate)
    entries = [
        BenchEntry(name, statistics.median(rates[name]),
                   predicted[shapes[name].layout.kind] if name in shapes else None)
        for name in chosen
    ]
    return BenchReport(tuple(entries), opts)


def _progress(names: list[str], show: bool) -> Iterable[str]:
    if not show:
        return names
    return _labelled(names)


def _labelled(names: list[str]) -> Iterator[str]:
    """A tqdm bar on stderr over the runs, showing the one running."""
    from tqdm import tqdm

    with tqdm(names, desc="bench", unit="run", leave=False) as bar:
        for name in bar:
            bar.set_postfix_str(name)
            yield name


def format_table(report: BenchReport) -> str:
    """The human table: samples/s, predicted, measured/predicted, then the ratios."""
    opts = report.options
    lines = [
        f"mlp 8x1024, 2 stages of 4 layers, 256 samples/update, {opts.steps} timed updates "
        f"after {opts.warmup} warm-up, median of {opts.rounds} interleaved rounds",
        f"{'run':<16} {'samples/s':>10} {'predicted':>10} {'meas/pred':>9}",
    ]
    for e in report.entries:
        pred = e.predicted_samples_per_s
        pred_s = f"{pred:10.1f}" if pred else f"{'':>10}"
        ratio = f"{e.samples_per_s / pred:9.2f}" if pred else f"{'':>9}"
        lines.append(f"{e.name:<16} {e.samples_per_s:10.1f} {pred_s} {ratio}")
    for ours, theirs, r in report.ratios():
        lines.append(f"{ours} / {theirs}: {r:.2f}x")
    return "\n".join(lines)

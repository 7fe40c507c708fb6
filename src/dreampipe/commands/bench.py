"""``dreampipe bench``: dreampipe's schedules against PyTorch's own, like for like.

One workload (:mod:`dreampipe.commands.workloads`: the mlp, GPT-style
transformer blocks, or Hugging Face's Llama), cut into 2 stages, one thread
per worker. dreampipe trains it on :class:`~dreampipe.api.pipeline.Pipeline`,
as a user's script would (:mod:`dreampipe.commands.bench_runs`); the
baselines (:mod:`dreampipe.commands.baselines`) are
``torch.distributed.pipelining``'s schedules on the same stages, DDP on 2
workers, and one process with 1 and 2 threads. Every run starts and is timed the same
way (:mod:`dreampipe.commands.bench_process`) and is repeated in interleaved
rounds (all runs once, then all again), so that a burst of load on a shared
machine does not decide a ratio (:mod:`dreampipe.commands.bench_report`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from dreampipe.api.config import TrainConfig
from dreampipe.api.pipeline import Pipeline
from dreampipe.commands.baselines import Baseline, baseline_microbatch_size, run_baseline
from dreampipe.commands.bench_names import BENCH_NAMES, default_runs
from dreampipe.commands.bench_process import run_ranks, timed_rate
from dreampipe.commands.bench_report import BenchEntry, BenchReport
from dreampipe.commands.bench_runs import DREAMPIPE_RUNS, DreampipeRun, predict
from dreampipe.commands.workloads import Workload, WorkloadKind
from dreampipe.errors import DreampipeError
from dreampipe.planning.plan import Plan

__all__ = ["BENCH_NAMES", "BenchOptions", "run_bench"]

log = logging.getLogger(__name__)

#: Longest wait of a dreampipe rank for its peer; the whole run has the bench's timeout.
_PEER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class BenchOptions:
    """The workload, timed and warm-up updates, rounds and the per-run hard limit."""

    workload: WorkloadKind = WorkloadKind.MLP
    steps: int = 20
    warmup: int = 3
    timeout_s: float = 300.0
    progress: bool = True
    rounds: int = 3

    def work(self) -> Workload:
        """The bench workload at these options' steps and warm-up."""
        return Workload.of(self.workload, steps=self.steps, warmup=self.warmup)


def _rank(rank: int, world: int, arg: tuple[DreampipeRun, Workload]) -> float:
    """One rank of a dreampipe run; samples/s."""
    run, work = arg
    v = run.virtual_stages
    x, y = work.data(run.minibatch(work))
    config = TrainConfig(schedule=run.kind.value, microbatches=run.layout(work).microbatches,
                         virtual_stages=v, fused_accumulation=run.fused_accumulation,
                         seed=work.seed, timeout_s=_PEER_TIMEOUT_S)
    model: torch.nn.Module
    plan: Plan | list[str]
    if work.hf:  # as a user passes a Hugging Face model: whole, with its split points
        model, plan = work.model(), work.split_points(v)
    else:
        spec = work.spec()
        plan = work.plan(v, run.kind.placement)
        model = spec.build_only(plan.layers_of_rank(rank), work.seed)
    pipe = Pipeline(model, example=(x, y), loss_fn=work.loss_fn,
                    optimizer=lambda params: torch.optim.SGD(params, lr=work.lr), plan=plan,
                    config=config)
    steps, warmup = run.steps(work, work.steps), run.steps(work, work.warmup)
    pipe.reserve(warmup + steps)  # as train does: no pause to extend the schedule while timed
    rate = timed_rate(lambda: pipe.step(x, y), steps=steps, warmup=warmup,
                      samples_per_step=run.minibatch(work), drain=pipe.finish)
    pipe.close()
    return rate


def run_dreampipe(run: DreampipeRun, work: Workload, timeout_s: float) -> float:
    """Samples/s of ``run`` on ``work``, in fresh processes."""
    return run_ranks(_rank, work.workers, (run, work), timeout_s=timeout_s)


def _samples_per_microbatch(name: str, work: Workload) -> int:
    if name in DREAMPIPE_RUNS:
        return DREAMPIPE_RUNS[name].layout(work).microbatch_size
    return baseline_microbatch_size(Baseline(name), work)


def run_bench(opts: BenchOptions, names: Sequence[str] | None = None) -> BenchReport:
    """Run the named runs (default: the workload's, :func:`default_runs`), each in fresh
    processes."""
    unknown = sorted(set(names or ()) - set(BENCH_NAMES))
    if unknown:
        raise DreampipeError(f"unknown bench run(s) {unknown}; choose from {list(BENCH_NAMES)}")
    chosen = [n for n in BENCH_NAMES if n in (names or default_runs(opts.workload))]
    work = opts.work()
    ours = [DREAMPIPE_RUNS[n] for n in chosen if n in DREAMPIPE_RUNS]
    predictions: list[dict[DreampipeRun, float]] = []
    rates: dict[str, list[float]] = {name: [] for name in chosen}
    for k, name in enumerate(_progress(chosen * opts.rounds, opts.progress)):
        if ours and k % len(chosen) == 0:  # each round predicts anew: the host drifts
            predictions.append(predict(ours, work))
        if name in DREAMPIPE_RUNS:
            rate = run_dreampipe(DREAMPIPE_RUNS[name], work, opts.timeout_s)
        else:
            rate = run_baseline(Baseline(name), work, timeout_s=opts.timeout_s)
        rates[name].append(rate)
        log.info("bench %s: %.1f samples/s", name, rate)
    entries = [
        BenchEntry(name, tuple(rates[name]), _samples_per_microbatch(name, work),
                   statistics.median(p[DREAMPIPE_RUNS[name]] for p in predictions)
                   if name in DREAMPIPE_RUNS and not work.hf else None)
        for name in chosen
    ]
    return BenchReport(tuple(entries), work)


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

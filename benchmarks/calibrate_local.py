"""Measure this machine's communication and update figures for :class:`LocalCalibration`.

The simulator predicts a local run from the layer profile plus figures the
profile cannot see (:mod:`dreampipe.machine.calibration`). This command measures
those that dominate on a CPU machine the way the runtime
incurs them, so that a user can rerun it on their own machine:

- ``bandwidth``: two local worker processes (gloo, one thread each)
  all-reduce the gradients of ``--model`` in the runtime's own buckets
  (:class:`~dreampipe.runtime.buckets.GradientBuckets`: flatten, all-reduce,
  copy back). For two ranks a ring moves ``n`` bytes per rank, so the figure
  is ``n / time``, the bandwidth the planner's ring term needs to give
  that time.
- ``step_bandwidth``: bytes of parameters one plain SGD step updates per
  second on one worker (the runtime's ``STEP`` action).
- ``stash_copy_bandwidth``: bytes of parameters per second a ``STEP``
  copies when a unit in flight still needs the version it replaces
  (weight stashing's copy-on-write, ``StageModule.step``).
- ``corun_slowdown``: how much slower one worker's forward and backward of
  ``--model`` (minibatch 32, one thread) run while another worker computes
  the same beside it than alone: the cores share caches and memory
  bandwidth, and the layer profile is taken alone.

``dreampipe train`` measures the first three itself, with its profile
(:mod:`dreampipe.machine.rates`, the same code), since they drift with the
host; the fixed figures serve profiles taken alone (the bench, a torchrun
job). It prints the mean of ``--repeats`` rounds of each rate (the
co-run factor: a ratio of medians) with their spread, and
the lines to put in ``PROJECT_MACHINE`` (or a calibration of your own)::

    python benchmarks/calibrate_local.py [--model mlp] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import torch.distributed as dist

from dreampipe.machine.corun import measure_corun
from dreampipe.machine.rates import HostRates, measure_rates
from dreampipe.models.resolve import resolve_spec
from dreampipe.quantities import format_bytes
from dreampipe.runtime.processes import run_processes

__all__ = ["main"]


@dataclass(frozen=True)
class _Job:
    model: str
    repeats: int


_BATCH = 32


def _rates(job: _Job) -> HostRates:
    """The runtime's bucketed all-reduce, SGD step and stash copy of ``job.model``'s
    parameters, ``job.repeats`` rounds each after one untimed."""
    params = list(resolve_spec(job.model, ()).build(seed=0).parameters())
    return measure_rates(params, rounds=job.repeats, min_time_s=0.0)


def _rank(rank: int, world: int, job: _Job) -> HostRates:
    """The all-reduce, SGD-step and stash-copy figures, from both ranks at once."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return _rates(job)
    finally:
        dist.destroy_process_group()


def _spread(values: tuple[float, ...]) -> str:
    return f"mean {statistics.fmean(values) * 1e3:.2f} ms " \
           f"({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Measure the all-reduce bandwidth between two local gloo workers, the "
                    "SGD step and stash copy rates and the slowdown of compute beside a busy "
                    "worker, as the runtime incurs them, for LocalCalibration.")
    parser.add_argument("--model", default="mlp",
                        help="zoo model whose parameters are all-reduced and stepped "
                             "(default: mlp, the train command's default model)")
    parser.add_argument("--repeats", type=int, default=9, help="rounds measured (default 9)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: measure at least 1 round")
    results = run_processes(_rank, 2, _Job(args.model, args.repeats), deadline_s=300.0)
    rates: HostRates = results[0]
    corun = measure_corun(args.model, _BATCH, repeats=args.repeats)
    bandwidth = rates.allreduce_bandwidth
    step_bandwidth, copy_bandwidth = rates.step_bandwidth, rates.stash_copy_bandwidth
    print(f"{args.model}: {format_bytes(rates.nbytes)} of gradients")
    print(f"all-reduce on 2 workers: {_spread(rates.allreduce_s)} -> {format_bytes(bandwidth)}/s")
    print(f"SGD step:                {_spread(rates.step_s)} -> {format_bytes(step_bandwidth)}/s")
    print(f"stash copy:              {_spread(rates.copy_s)} -> {format_bytes(copy_bandwidth)}/s")
    print(f"at minibatch {_BATCH}: {corun.describe()}")
    print("for LocalCalibration:")
    print(f'    bandwidth="{bandwidth / 1e6:.0f}MB/s",')
    print(f"    step_bandwidth={step_bandwidth:.3g},")
    print(f"    corun_slowdown={corun.slowdown:.3f},")
    print(f"    stash_copy_bandwidth={copy_bandwidth:.3g},")


if __name__ == "__main__":
    main()

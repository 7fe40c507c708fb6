"""Measure this machine's communication and update figures for :class:`LocalCalibration`.

The simulator predicts a local run from the layer profile plus figures the
profile cannot see (:mod:`dreampipe.jobs.machine`). This command measures
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

It prints the median of ``--repeats`` rounds with their spread, and the two
lines to put in ``PROJECT_MACHINE`` (or a calibration of your own)::

    python benchmarks/calibrate_local.py [--model mlp] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dreampipe.jobs.corun import measure_corun
from dreampipe.models.resolve import resolve_spec
from dreampipe.quantities import format_bytes
from dreampipe.runtime.buckets import GradientBuckets
from dreampipe.runtime.processes import run_processes
from dreampipe.scheduling.actions import Action, ActionKind

__all__ = ["main"]

_ACTION = Action(ActionKind.ALLREDUCE, 0, 0)


@dataclass(frozen=True)
class _Job:
    model: str
    repeats: int


_BATCH = 32


def _seconds(job: _Job) -> tuple[list[float], list[float], list[float], int]:
    """All-reduce, SGD-step and stash-copy seconds per round, and the gradient bytes."""
    params = list(resolve_spec(job.model, ()).build(seed=0).parameters())
    grads = [torch.ones_like(p) for p in params]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    buckets = GradientBuckets(params, None, lambda work, _a: work.wait())
    optimizer = torch.optim.SGD(params, lr=1e-3)
    reduce_s, step_s, copy_s = [], [], []
    for i in range(job.repeats + 1):  # the first round warms up
        dist.barrier()
        start = time.perf_counter()
        buckets.finish(grads, _ACTION, 0.5)
        took = time.perf_counter() - start
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        start = time.perf_counter()
        optimizer.step()
        stepped = time.perf_counter() - start
        start = time.perf_counter()
        for p in params:  # StageModule.step's copy-on-write of a version still in use
            p.data = p.data.clone()
        copied = time.perf_counter() - start
        if i:
            reduce_s.append(took)
            step_s.append(stepped)
            copy_s.append(copied)
    return reduce_s, step_s, copy_s, nbytes


def _rank(rank: int, world: int, job: _Job) -> tuple[list[float], list[float], list[float], int]:
    """The all-reduce, SGD-step and stash-copy figures, from both ranks at once."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return _seconds(job)
    finally:
        dist.destroy_process_group()


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1e3:.2f} ms " \
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
    reduce_s, step_s, copy_s, nbytes = results[0]
    corun = measure_corun(args.model, _BATCH, repeats=args.repeats)
    bandwidth = nbytes / statistics.median(reduce_s)
    step_bandwidth = nbytes / statistics.median(step_s)
    copy_bandwidth = nbytes / statistics.median(copy_s)
    print(f"{args.model}: {format_bytes(nbytes)} of gradients")
    print(f"all-reduce on 2 workers: {_spread(reduce_s)} -> {format_bytes(bandwidth)}/s")
    print(f"SGD step:                {_spread(step_s)} -> {format_bytes(step_bandwidth)}/s")
    print(f"stash copy:              {_spread(copy_s)} -> {format_bytes(copy_bandwidth)}/s")
    print(f"at minibatch {_BATCH}: {corun.describe()}")
    print("for LocalCalibration:")
    print(f'    bandwidth="{bandwidth / 1e6:.0f}MB/s",')
    print(f"    step_bandwidth={step_bandwidth:.3g},")
    print(f"    corun_slowdown={corun.slowdown:.3f},")
    print(f"    stash_copy_bandwidth={copy_bandwidth:.3g},")


if __name__ == "__main__":
    main()

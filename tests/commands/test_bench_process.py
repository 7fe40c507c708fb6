"""``commands.bench_process``: every run in fresh processes sharing one gloo group, and timed
from a barrier after the warm-up to a barrier after the timed steps and their drain."""

from __future__ import annotations

import gc
import multiprocessing
import time
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import dreampipe.commands.bench_process as bench_process
from dreampipe.commands.bench_process import run_ranks, timed_rate
from dreampipe.errors import BaselineError, PlanError
from dreampipe.runtime.processes import HeapPolicy

__all__: list[str] = []


@settings(max_examples=60, deadline=None)
@given(step_s=st.lists(st.floats(0.001, 5.0), min_size=1, max_size=12), data=st.data(),
       drain_s=st.tuples(st.floats(0.0, 3.0), st.floats(0.0, 3.0)) | st.none(),
       samples=st.integers(1, 1024))
def test_the_clock_runs_over_the_timed_steps_and_their_drain_only(
    step_s: list[float], data: st.DataObject, drain_s: tuple[float, float] | None,
    samples: int,
) -> None:
    """On a clock that moves only when a step or drain runs."""
    warmup = data.draw(st.integers(0, len(step_s) - 1))
    steps = len(step_s) - warmup
    clock = [0.0]
    durations = iter(step_s)
    drains = iter(drain_s or ())
    calls: list[str] = []

    def step() -> None:
        calls.append("step")
        clock[0] += next(durations)

    def drain() -> None:
        calls.append("drain")
        clock[0] += next(drains)

    fake_time = SimpleNamespace(perf_counter=lambda: clock[0])
    with mock.patch.object(bench_process, "time", fake_time):
        rate = timed_rate(step, steps=steps, warmup=warmup, samples_per_step=samples,
                          drain=drain if drain_s is not None else None)
    timed = sum(step_s[warmup:]) + (drain_s[1] if drain_s is not None else 0.0)
    assert rate == pytest.approx(steps * samples / timed)
    with_drain = ["drain"] if drain_s is not None else []
    assert calls == ["step"] * warmup + with_drain + ["step"] * steps + with_drain


def _group(rank: int, world: int, arg: float) -> float:
    """The sum over the ranks of ``arg * (rank + 1)``, if they share a gloo group."""
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world)
    total = torch.tensor([arg * (rank + 1)])
    dist.all_reduce(total)
    return float(total.item()) + rank * 1000  # rank 0's is the one returned


def _alone(rank: int, world: int, arg: None) -> float:
    """A lone rank's set-up in one number: a group (1), its threads (times 10), and whether
    its start-up objects are frozen out of the collector's reach, as all but a stock heap's
    are (100)."""
    return (10 * torch.get_num_threads() + int(dist.is_initialized())
            + 100 * int(gc.get_freeze_count() > 0))


def _fails(rank: int, world: int, arg: str) -> float:
    if rank == 1:
        raise PlanError(arg)
    return 1.0


def _uneven(rank: int, world: int, arg: None) -> float:
    """Rank 1 takes 2 s to warm up and 0.2 s a timed step; rank 0 no time at all."""
    calls = [0]

    def step() -> None:
        calls[0] += 1
        if rank == 1:
            time.sleep(2.0 if calls[0] == 1 else 0.2)

    return timed_rate(step, steps=2, warmup=1, samples_per_step=10)


@pytest.mark.timing  # measured seconds: alone on the cores (make test)
def test_the_clock_starts_and_stops_at_barriers_on_all_ranks() -> None:
    """Rank 0's clock leaves out its peer's warm-up and waits for its peer's timed steps."""
    rate = run_ranks(_uneven, 2, None, timeout_s=60)
    assert 2 * 10 / 2.0 < rate <= 2 * 10 / 0.4


def test_ranks_share_one_gloo_group_and_rank_0s_result_comes_back() -> None:
    assert run_ranks(_group, 2, 1.5, timeout_s=60) == 1.5 + 3.0
    assert multiprocessing.active_children() == []


def test_a_lone_rank_has_no_group_and_the_threads_asked() -> None:
    assert run_ranks(_alone, 1, None, timeout_s=60, threads=2) == 120.0
    assert run_ranks(_alone, 1, None, timeout_s=60, heap=HeapPolicy.STOCK) == 10.0


def test_a_failing_rank_raises_the_asked_class_with_its_traceback() -> None:
    with pytest.raises(BaselineError, match=r"(?s)rank 1 failed: PlanError: no plan.*"
                                            r"--- traceback of rank 1 ---"):
        run_ranks(_fails, 2, "no plan", timeout_s=60, error=BaselineError)
    with pytest.raises(PlanError, match="rank 1 failed: PlanError: its own class"):
        run_ranks(_fails, 2, "its own class", timeout_s=60)

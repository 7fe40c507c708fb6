"""Point-to-point latency and bandwidth: the fit, and a ping-pong between two processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dreampipe.machine.pingpong import LineFit, PingPong, ping_pong
from dreampipe.machine.timers import CudaTimer, WallTimer, timer_for
from dreampipe.runtime.processes import run_processes

__all__: list[str] = []


def test_the_fit_recovers_latency_and_bandwidth() -> None:
    sizes = [4096, 65536, 1 << 20, 8 << 20]
    fit = LineFit.of(sizes, [20e-6 + n / 2.5e6 for n in sizes])
    assert fit.fixed_s == pytest.approx(20e-6, abs=1e-9)
    assert fit.bandwidth == pytest.approx(2.5e6)
    flat = LineFit.of(sizes, [1e-3, 2e-3, 1e-3, 1e-3])  # no slope: latency alone
    assert flat.bandwidth >= 1e12 and flat.fixed_s == pytest.approx(1e-3)
    # 60 us + bytes at 100 MB/s, the largest 5% fast: the least-squares line's intercept
    # would be 338 us; the smallest size still says the latency
    noisy = LineFit.of(sizes, [101e-6, 715e-6, 10.9e-3, 80e-3])
    assert noisy.fixed_s == pytest.approx(101e-6 - 4096 / noisy.bandwidth)
    assert 50e-6 < noisy.fixed_s < 70e-6 and 95e6 < noisy.bandwidth < 115e6
    assert LineFit.of([4096], [3e-3]) == LineFit(3e-3, flat.bandwidth)


def test_wall_timer_times_the_call_and_a_gpu_gets_cuda_events() -> None:
    assert type(timer_for(torch.device("cpu"))) is WallTimer
    assert type(timer_for(torch.device("cuda", 0))) is CudaTimer  # made, not run: no GPU here
    assert WallTimer()(lambda: sum(range(10_000))) > 0


def _pong(rank: int, world: int, budget_s: float) -> PingPong | None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return ping_pong((0, 1), (4096, 1 << 20, 4 << 20), budget_s=budget_s, min_time_s=0.0,
                         device=torch.device("cpu"), timer=WallTimer())
    finally:
        dist.destroy_process_group()


def test_a_ping_pong_times_each_size_until_a_round_trip_passes_the_budget() -> None:
    found = run_processes(_pong, 2, 10.0, deadline_s=60.0)
    pong = found[0]
    assert found[1] is None and isinstance(pong, PingPong)
    assert pong.sizes == (4096, 1 << 20, 4 << 20)
    assert all(t > 0 for t in pong.one_way_s + pong.post_s)
    assert pong.link.bandwidth > 0 and pong.link.fixed_s >= 0
    first = run_processes(_pong, 2, 0.0, deadline_s=60.0)[0]  # every round trip is too long
    assert isinstance(first, PingPong) and first.sizes == (4096,)

"""The host's all-reduce, step and stash-copy rates (:mod:`dreampipe.machine.rates`)."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from dreampipe.machine.calibration import local_costs, measured_machine
from dreampipe.machine.rates import HostRates, measure_rates, with_host_rates
from dreampipe.planning.plan import Plan
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.quantities import parse_bandwidth
from dreampipe.runtime.processes import run_processes
from machine.fixtures import DEV_MACHINE

__all__: list[str] = []

_GRAPH = LayerGraph(
    tuple(Layer(f"l{i}", 2.0, 4.0, 32 * 1024, 4 * 1024 * 1024) for i in range(4)),
    tuple((i, i + 1) for i in range(3)), 32, "toy",
)


def test_bandwidths_are_bytes_over_the_mean_round_and_a_ring_moves_2_w_minus_1_over_w() -> None:
    rates = HostRates(nbytes=1000, world=4, allreduce_s=(0.1, 0.4, 0.1),
                      step_s=(0.5, 0.1, 0.3), copy_s=(0.4, 0.2, 0.3))
    assert rates.allreduce_bandwidth == pytest.approx(2 * 3 / 4 * 1000 / 0.2)
    assert rates.step_bandwidth == pytest.approx(1000 / 0.3)
    assert rates.stash_copy_bandwidth == pytest.approx(1000 / 0.3)
    alone = HostRates(nbytes=1000, world=1, allreduce_s=(), step_s=(0.1,), copy_s=(0.1,))
    assert alone.allreduce_bandwidth == math.inf
    assert "allreduce_bandwidth" not in with_host_rates(_GRAPH, alone).meta


def test_one_process_times_steps_and_copies_for_at_least_the_minimum_time() -> None:
    params = [torch.zeros(256, 256), torch.zeros(256)]
    before = [p.clone() for p in params]
    start = time.perf_counter()
    rates = measure_rates(params, rounds=2, min_time_s=0.05)
    assert time.perf_counter() - start >= 2 * 0.05  # steps, then copies, each for 0.05 s
    assert rates.world == 1 and rates.allreduce_s == ()
    assert rates.nbytes == (256 * 256 + 256) * 4
    assert len(rates.step_s) >= 2 and len(rates.copy_s) >= 2
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))  # untouched
    with pytest.raises(ValueError, match="rounds=0"):
        measure_rates(params, rounds=0)


def _rank(rank: int, world: int, _job: None) -> HostRates:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return measure_rates([torch.zeros(64, 1024)], rounds=3, min_time_s=0.02)
    finally:
        dist.destroy_process_group()


def test_workers_all_reduce_the_same_number_of_rounds_together() -> None:
    results: list[HostRates] = run_processes(_rank, 2, None, deadline_s=60.0)
    assert [r.world for r in results] == [2, 2]
    assert len(results[0].allreduce_s) == len(results[1].allreduce_s) >= 3
    assert all(0 < t < 5 for r in results for t in r.allreduce_s)
    assert all(0 < r.allreduce_bandwidth < math.inf for r in results)


def _turns_rank(rank: int, world: int, _job: None) -> tuple[HostRates, int]:
    calls = [0]

    def beside() -> None:
        calls[0] += 1
        time.sleep(0.002)

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rates = measure_rates([torch.zeros(64, 1024)], rounds=3, min_time_s=0.05,
                              beside=beside)
        return rates, calls[0]
    finally:
        dist.destroy_process_group()


def test_with_a_training_round_beside_ranks_time_their_copies_in_turn_while_others_compute(
) -> None:
    results: list[tuple[HostRates, int]] = run_processes(_turns_rank, 2, None, deadline_s=60.0)
    for rates, calls in results:
        assert len(rates.copy_s) >= 3 and rates.stash_copy_bandwidth > 0
        # the other rank timed 0.05 s of copies meanwhile: ~25 rounds of 2 ms
        assert calls >= 5


def test_measured_rates_replace_the_machines_fixed_figures() -> None:
    rates = HostRates(nbytes=10**6, world=2, allreduce_s=(1e-3,), step_s=(2e-4,),
                      copy_s=(4e-4,))
    graph = with_host_rates(_GRAPH, rates)
    machine = measured_machine(graph, DEV_MACHINE)
    assert machine.bandwidth == "1e+09B/s"
    assert machine.step_bandwidth == pytest.approx(5e9)
    assert machine.stash_copy_bandwidth == pytest.approx(2.5e9)
    assert machine.loss_s == DEV_MACHINE.loss_s  # what was not measured stays
    assert measured_machine(_GRAPH, DEV_MACHINE) == DEV_MACHINE
    plan = Plan.from_config(4, [0], [2])
    fast, fixed = local_costs(graph, plan, 1.0, machine), local_costs(graph, plan, 1.0, DEV_MACHINE)
    fixed_bandwidth = parse_bandwidth(DEV_MACHINE.bandwidth)
    assert fast.allreduce_s[0] == pytest.approx(
        fixed.allreduce_s[0] * fixed_bandwidth / 1e9, rel=0.01)

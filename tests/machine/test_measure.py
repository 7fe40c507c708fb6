"""Measuring this machine (:mod:`dreampipe.machine.measure`), and what a job does without a file."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dreampipe.errors import ConfigError
from dreampipe.machine import measure
from dreampipe.machine.calibration import LocalCalibration
from dreampipe.machine.machine_file import ENV_VAR, MachineFile, here
from dreampipe.quantities import parse_bandwidth
from dreampipe.runtime import backend
from dreampipe.runtime.backend import Backend
from dreampipe.runtime.processes import run_processes
from machine.fixtures import DEV_FILE, DEV_MACHINE, here_file

__all__: list[str] = []


def test_a_quick_calibration_measures_every_figure_of_one_node() -> None:
    found = measure.calibrate_local(2, measure.QUICK)
    assert found.identity.hostname == here().hostname and found.backend is Backend.GLOO
    assert found.node is not None and found.nodes is None
    assert found.node.workers == 2
    for figure in (found.node.allreduce_bandwidth, found.node.p2p_bandwidth,
                   found.step_bandwidth, found.stash_copy_bandwidth,
                   found.send_copy_bandwidth):
        assert 1e6 < figure < 1e14
    assert 0 <= found.node.latency_s < 0.1 and 0 <= found.send_overhead_s < 0.1
    assert found.corun_slowdown >= 1.0
    assert found.split_layer_forward_s is not None and found.split_layer_backward_s is not None
    assert 0 <= found.split_layer_forward_s < 0.1 and 0 <= found.split_layer_backward_s < 0.1
    how = dict(found.how)
    assert "beside a busy twin" in how["corun_slowdown"] and "ping-pong" in found.node.how
    assert set(how) >= {"step_bandwidth", "stash_copy_bandwidth", "corun_slowdown",
                        "send_overhead_s", "loss_s", "split_layer_forward_s"}
    assert MachineFile.from_dict(found.to_dict()) == found
    assert any("all-reduce" in line for line in measure.describe(found))


def test_links_need_two_workers() -> None:
    with pytest.raises(ConfigError, match="workers=1"):
        measure.calibrate_local(1)


@pytest.mark.parametrize(("gpus", "cores", "workers", "says"), [
    (8, 64, 16, "8 GPUs.*workers=8 or fewer"), (0, 2, 64, "2 cores.*workers=2 or fewer"),
    (0, 1, 3, "2 cores"), (1, 2, 3, "2 cores")])
def test_more_workers_than_the_machine_runs_apart_are_refused(
        monkeypatch: pytest.MonkeyPatch, gpus: int, cores: int, workers: int,
        says: str) -> None:
    """Beyond the GPUs, workers would fall back to gloo and measure the CPU's links as the
    GPUs'; beyond the cores (2 at least), their own contention. Refused before any starts."""
    monkeypatch.setattr(backend, "gpus_here", lambda: gpus)
    monkeypatch.setattr(backend.os, "cpu_count", lambda: cores)

    def started(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("processes started")

    monkeypatch.setattr(measure, "run_processes", started)
    with pytest.raises(ConfigError, match=f"workers={workers}: this machine has {says}"):
        measure.calibrate_local(workers)


def test_one_gpu_calibrates_two_workers_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU has no link to another: its quick calibration runs 2 workers over gloo, as
    every job without a machine file does there."""
    monkeypatch.setattr(backend, "gpus_here", lambda: 1)
    monkeypatch.setattr(backend.os, "cpu_count", lambda: 16)

    class Started(Exception):
        pass

    def started(*_args: object, **_kwargs: object) -> None:
        raise Started

    monkeypatch.setattr(measure, "run_processes", started)
    with pytest.raises(Started):
        measure.calibrate_local(2)


def test_a_job_plans_with_the_file_without_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, str(here_file(DEV_FILE, tmp_path / "m.json")))

    def no_measuring(*_args: object, **_kwargs: object) -> MachineFile:
        raise AssertionError("measured although a machine file exists")

    monkeypatch.setattr(measure, "calibrate_local", no_measuring)
    assert measure.machine_for_run(2) == DEV_MACHINE


def test_without_a_file_a_job_measures_quickly_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "none.json"))
    made = MachineFile.load(DEV_FILE)
    asked: list[tuple[int, measure.Probe]] = []

    def measured(workers: int, probe: measure.Probe = measure.FULL,
                 say: object = None) -> MachineFile:
        asked.append((workers, probe))
        return made

    monkeypatch.setattr(measure, "calibrate_local", measured)
    monkeypatch.setattr(measure, "_quick_machines", {})
    said: list[str] = []
    with caplog.at_level(logging.WARNING):
        got = measure.local_machine(3)
        again = measure.local_machine(3, say=said.append)  # measured once per process
    assert got == again == made.calibration()
    assert asked == [(2, measure.QUICK)]  # between 2 workers
    [warned] = caplog.records
    assert warned.levelno == logging.WARNING and "dreampipe calibrate" in warned.getMessage()
    assert "none.json" in warned.getMessage() and not said
    monkeypatch.setattr(measure, "_quick_machines", {})
    with caplog.at_level(logging.WARNING):
        measure.local_machine(2, say=said.append)  # a command says it instead
    assert len(said) == 1 and said[0] == warned.getMessage() and len(caplog.records) == 1
    assert parse_bandwidth(got.bandwidth) == pytest.approx(572e6)


def _in_group(rank: int, world: int, nodes: int) -> LocalCalibration:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        machine = measure.machine_in_group(nodes=nodes)
        dist.barrier()  # the measurement's groups are gone, the job's still works
        return machine
    finally:
        dist.destroy_process_group()


def _draws_after_measuring(rank: int, world: int, _: None) -> tuple[list[float], list[float]]:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)
        want = torch.rand(3).tolist()
        torch.manual_seed(rank)
        measure.machine_in_group()
        return want, torch.rand(3).tolist()
    finally:
        dist.destroy_process_group()


def test_measuring_the_machine_leaves_the_ranks_random_draws_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its probes draw inputs: a run's dropout must not depend on whether a machine file
    was there to spare the measurement."""
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "none.json"))
    for want, got in run_processes(_draws_after_measuring, 2, None, deadline_s=60.0):
        assert got == want


def test_ranks_of_a_group_measure_together_when_rank_0_has_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, str(here_file(DEV_FILE, tmp_path / "m.json")))
    got = run_processes(_in_group, 2, 1, deadline_s=60.0)
    assert got == [DEV_MACHINE, DEV_MACHINE]  # the file's
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "none.json"))
    one, two = run_processes(_in_group, 2, 1, deadline_s=60.0)
    assert one == two != DEV_MACHINE and one.outer_bandwidth is None
    # a job over 2 nodes of 1 worker each: the file's one level is not enough, and the
    # link between the nodes is measured (here, loopback between the two processes)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "m.json"))
    one, two = run_processes(_in_group, 2, 2, deadline_s=60.0)
    assert one == two and one.outer_bandwidth is not None and one.corun_slowdown == 1.0

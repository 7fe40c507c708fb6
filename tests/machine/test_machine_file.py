"""The machine file: JSON that round-trips, where it lives, and a file from elsewhere noticed."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from dreampipe.errors import ConfigError
from dreampipe.machine.calibration import local_topology
from dreampipe.machine.machine_file import (
    ENV_VAR,
    LinkFigures,
    MachineFile,
    default_path,
    here,
    load_machine_file,
)
from dreampipe.quantities import parse_bandwidth
from dreampipe.runtime.backend import Backend
from machine.fixtures import DEV_FILE, NVLINK_FILE, here_file

__all__: list[str] = []


def test_a_machine_file_round_trips_through_json(tmp_path: Path) -> None:
    found = MachineFile.load(NVLINK_FILE)
    two_level = dataclasses.replace(found, nodes=LinkFigures(
        workers=4, backend=Backend.NCCL, allreduce_bandwidth=40e9, p2p_bandwidth=45e9,
        latency_s=3e-6, how="4 x 400 Gbps InfiniBand"))
    for machine in (found, two_level, MachineFile.load(DEV_FILE)):
        assert MachineFile.from_dict(json.loads(machine.to_json())) == machine
        machine.save(tmp_path / "m.json")
        assert MachineFile.load(tmp_path / "m.json") == machine
    assert json.loads(two_level.to_json())["nodes"]["allreduce_bandwidth"] == 40e9
    assert json.loads(two_level.to_json())["nodes"]["backend"] == "nccl"  # plain JSON
    assert dict(found.how)["corun_slowdown"].startswith("one GPU per worker")
    split = dataclasses.replace(found, split_layer_forward_s=1e-4, split_layer_backward_s=2e-4)
    assert MachineFile.from_dict(json.loads(split.to_json())) == split
    assert split.calibration().split_layer_backward_s == 2e-4


def test_a_file_without_the_split_layer_cost_loads_and_says_to_measure_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = json.loads(MachineFile.load(DEV_FILE).to_json())
    for key in ("split_layer_forward_s", "split_layer_backward_s"):
        data.pop(key, None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**data, "identity": here().__dict__}))
    with caplog.at_level(logging.WARNING):
        found = load_machine_file(old)
    assert found is not None and found.split_layer_forward_s is None
    assert found.calibration().split_layer_forward_s == 0.0  # priced as before
    assert "tensor-split layer" in caplog.text and "dreampipe calibrate" in caplog.text


def test_the_calibration_holds_the_files_figures_per_level() -> None:
    found = MachineFile.load(NVLINK_FILE)
    assert found.node is not None
    machine = found.calibration()
    assert parse_bandwidth(machine.bandwidth) == pytest.approx(found.node.allreduce_bandwidth)
    assert machine.latency_s == found.node.latency_s
    assert machine.step_bandwidth == found.step_bandwidth and machine.overlap  # NCCL
    assert machine.outer_bandwidth is None
    with pytest.raises(ConfigError, match=r"no link between nodes.*dreampipe calibrate"):
        local_topology(16, machine, nodes=2)
    outer = LinkFigures(workers=2, backend=Backend.NCCL, allreduce_bandwidth=5e9, p2p_bandwidth=6e9,
                        latency_s=40e-6, how="")
    topo = local_topology(16, dataclasses.replace(found, nodes=outer).calibration(), nodes=2)
    assert [lv.count for lv in topo.levels] == [8, 2]
    assert [lv.bandwidth for lv in topo.levels] == pytest.approx([150e9, 5e9])
    assert [lv.latency for lv in topo.levels] == pytest.approx([12e-6, 40e-6])


def test_one_worker_per_node_plans_with_the_link_between_nodes() -> None:
    outer = LinkFigures(workers=2, backend=Backend.GLOO, allreduce_bandwidth=2e6,
                        p2p_bandwidth=2.5e6, latency_s=1e-3, how="")
    found = dataclasses.replace(MachineFile.load(DEV_FILE), node=None, nodes=outer)
    assert found.calibration().outer_bandwidth == found.calibration().bandwidth
    with pytest.raises(ConfigError, match="one level at least"):
        dataclasses.replace(found, nodes=None)


def test_the_path_is_the_env_var_else_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "mine.json"))
    assert default_path() == tmp_path / "mine.json"
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_path() == tmp_path / "cache" / "dreampipe" / "machine.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_path() == tmp_path / "home" / ".cache" / "dreampipe" / "machine.json"


def test_no_file_is_none_and_a_file_made_here_loads_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "none.json"))
    assert load_machine_file() is None
    monkeypatch.setenv(ENV_VAR, str(here_file(DEV_FILE, tmp_path / "here.json")))
    with caplog.at_level(logging.WARNING):
        found = load_machine_file()
    assert found is not None and found.identity.hostname == here().hostname
    assert not caplog.records


@pytest.mark.parametrize("field", ["hostname", "devices", "torch_version"])
def test_a_file_made_on_another_machine_warns_to_calibrate(
    field: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    made_here = MachineFile.load(here_file(DEV_FILE, tmp_path / "here.json"))
    elsewhere = dataclasses.replace(
        made_here, identity=dataclasses.replace(made_here.identity, **{field: "other"}))
    elsewhere.save(tmp_path / "there.json")
    with caplog.at_level(logging.WARNING):
        found = load_machine_file(tmp_path / "there.json")
    assert found == elsewhere  # still used, but noticed
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert f"{field} 'other'" in record.getMessage()
    assert "dreampipe calibrate" in record.getMessage()


def test_a_file_of_another_kind_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"version": 1, "identity": {}}))
    with pytest.raises(ConfigError, match=r"bad\.json.*dreampipe calibrate"):
        MachineFile.load(path)
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(ConfigError, match="version 99"):
        MachineFile.load(path)

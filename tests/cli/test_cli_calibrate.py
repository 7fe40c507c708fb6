"""``dreampipe calibrate``: measures this machine, writes the machine file, --json prints it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from torchrun import agent_command, run_agents

import dreampipe
from dreampipe.cli import main
from dreampipe.machine.machine_file import ENV_VAR, MachineFile, here
from dreampipe.runtime.processes import free_port

__all__: list[str] = []

_SRC = Path(dreampipe.__file__).resolve().parents[1]


def test_calibrate_json_prints_and_writes_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "m.json"
    assert main(["calibrate", "--quick", "--json", "-o", str(target)]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)  # the JSON alone on stdout
    written = MachineFile.load(target)
    assert MachineFile.from_dict(printed) == written
    assert written.identity.hostname == here().hostname
    assert written.node is not None and written.node.workers == 2
    assert "inside a node (2 workers, gloo): all-reduce" in err  # progress on stderr
    assert "co-run" in err and f"wrote {target}" in err


def test_calibrate_writes_the_default_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "sub" / "machine.json"))
    assert main(["calibrate", "--quick"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and MachineFile.load(tmp_path / "sub" / "machine.json").node is not None
    assert "wrote" in err


def test_calibrate_refuses_a_directory_an_empty_name_and_one_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["calibrate", "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "default.json"))
    assert main(["calibrate", "-o", ""]) == 2  # not the default file
    assert "--output '' names no file" in capsys.readouterr().err
    assert not (tmp_path / "default.json").exists()
    assert main(["calibrate", "--workers", "1", "-o", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert "--workers 1" in err and "2 workers or more" in err
    assert not (tmp_path / "m.json").exists()


def test_calibrate_help_names_the_file_and_the_levels(
    capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "DREAMPIPE_MACHINE_FILE" in text and "--nnodes" in text and "--json" in text


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_calibrate_under_torchrun_on_two_nodes_writes_both_levels_once(tmp_path: Path) -> None:
    """Two torchrun agents on 127.0.0.1, one worker each: no link inside a node to time,
    the one between them measured; rank 0 (on either node) writes and prints the file."""
    target = tmp_path / "m.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": str(_SRC)}
    port = free_port()
    cmds = [agent_command(node, nnodes=2, nproc=1, endpoint=f"127.0.0.1:{port}",
                          run_id=f"cal{os.getpid()}", local_addr="127.0.0.1",
                          target=["-m", "dreampipe", "calibrate", "--quick", "--json", "-o",
                                  str(target)])
            for node in (0, 1)]
    ran = run_agents(cmds, [env, env], tmp_path, timeout_s=120)
    errs = [err[-3000:] for _, _, err in ran]
    assert [code for code, _, _ in ran] == [0, 0], errs
    printed = [ln for _, out, _ in ran for ln in out.splitlines() if ln.startswith("{")]
    assert len(printed) == 1, (printed, errs)
    written = MachineFile.load(target)
    assert MachineFile.from_dict(json.loads(printed[0])) == written
    assert written.node is None and written.nodes is not None and written.nodes.workers == 2
    assert written.corun_slowdown == 1.0  # one worker per node computes beside none
    assert "between nodes (2 nodes, gloo)" in "".join(errs)
    assert written.calibration().outer_bandwidth is not None

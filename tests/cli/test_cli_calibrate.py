"""``dreampipe calibrate``: measures this machine, writes the machine file, --json prints it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dreampipe.cli import main
from dreampipe.machine.machine_file import ENV_VAR, MachineFile, here

__all__: list[str] = []


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


def test_calibrate_refuses_a_directory_and_one_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["calibrate", "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
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

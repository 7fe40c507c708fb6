"""``--trace`` and ``--timeline`` are checked before any work (``cli/output_paths.py``):
a directory, a missing directory, or a timeline that is no image is one line naming the
fix, from ``simulate`` and ``train`` alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from dreampipe.cli import main
from dreampipe.cli.output_paths import check_output_paths, check_run_paths
from dreampipe.errors import ConfigError

__all__: list[str] = []


@pytest.mark.parametrize(("name", "said"), [
    ("t.txt", "end the name in one of .png"),
    ("t", "end the name in one of .png"),
    ("missing/t.png", "does not exist; create it"),
    ("", "name a file, e.g. --timeline timeline.png"),
])
def test_a_timeline_that_would_fail_or_land_elsewhere_is_refused(
        tmp_path: Path, name: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        check_output_paths(None, tmp_path / name if name else "")


def test_an_image_in_an_existing_directory_passes(tmp_path: Path) -> None:
    for suffix in (".png", ".SVG", ".pdf"):
        check_output_paths(tmp_path / "trace.json", tmp_path / f"t{suffix}")
    with pytest.raises(ConfigError, match="is a directory"):
        check_output_paths(tmp_path, None)


@pytest.mark.parametrize("command", [
    ["simulate", "pipedream:gnmt", "-t", "4"],
    ["train", "mlp", "--steps", "1", "--no-progress"],
])
def test_each_command_refuses_before_it_runs(
        command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--timeline", str(tmp_path / "t.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "end the name in one of .png" in err
    assert not list(tmp_path.iterdir())


def test_a_runs_data_log_and_checkpoints_are_checked_before_its_workers_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    for extra, said in ((["--data-log", str(tmp_path)], "--data-log"),
                        (["--checkpoint-dir", str(afile), "--checkpoint-every", "1"],
                         "is a file, not a directory")):
        assert main(["train", "mlp", "--steps", "1", "--no-progress", *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "rank 0" not in err
    check_run_paths(tmp_path / "new" / "log.jsonl", tmp_path / "new")  # made by the run

"""A crash during a save leaves the previous checkpoint loadable, and ``--resume`` uses it.

The test runs ``dreampipe train`` under torchrun with checkpoint writes that
stall in the second save (:mod:`.paused_save`, launched by the test: the
product has no hook), SIGKILLs rank 0 there, the rank that would commit,
then resumes.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from torchrun import descendants, started, torchrun_command, worker_env

from dreampipe.api import checkpoint, load_model_state
from dreampipe.cli import main
from dreampipe.errors import CheckpointError
from dreampipe.models import get_model

from .jobs import effective, read_log, tail, train_argv, wait_for

__all__: list[str] = []

_STEPS, _EVERY = 60, 20
_PLAN = ("--config", "straight", "--stages", "0,2")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_crash_during_a_save_leaves_the_last_checkpoint_and_resume_uses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mlp_profile: Callable[[int], Path]
) -> None:
    ck = tmp_path / "ck"
    partial = ck / f"step-{2 * _EVERY}.tmp"
    script = Path(__file__).with_name("paused_save.py")
    cmd = torchrun_command(str(script), partial.name,
                           *train_argv(ck, *_PLAN, steps=_STEPS, every=_EVERY,
                                       profile=mlp_profile(16)))
    with started(cmd, tmp_path / "torchrun") as proc:
        wait_for(f"both ranks' files in {partial.name}", lambda: all(
            (partial / f"__{r}_0.distcp").is_file() for r in (0, 1)),
            lambda: proc.poll() is None, 180.0)
        writer = next(p for p in descendants(proc.pid) if worker_env(p).get("RANK") == "0")
        os.kill(writer, signal.SIGKILL)
        code = proc.wait(timeout=60)
    assert code != 0, tail(tmp_path / "torchrun.stderr")

    # the save never committed; the one before it is whole and is what the folder offers
    last = ck / f"step-{_EVERY}"
    assert not (partial / checkpoint.MARKER).exists() and partial.is_dir()
    assert checkpoint.partial(ck) == [partial]
    assert checkpoint.latest(ck) == last == checkpoint.find(ck)
    with pytest.raises(CheckpointError, match=f"never committed .* last complete one is {last}"):
        checkpoint.find(partial)
    model = get_model("mlp", layers=4, width=32).build()
    model.load_state_dict(load_model_state(ck))  # every key, every shape

    # --resume removes the partial save and continues from the last whole one
    assert main(train_argv(ck, *_PLAN, steps=_STEPS, every=_EVERY,
                           profile=mlp_profile(16))) == 0
    said = capsys.readouterr().err
    print(f"\ncrash during a save: {partial.name} left without {checkpoint.MARKER}; the next "
          f"run said:\n  " + "\n  ".join(ln for ln in said.splitlines()
                                       if ln.startswith(("removed", "resuming"))))
    assert f"removed {partial}: its save never committed" in said, said
    assert f"resuming from {last} at minibatch {_EVERY}, on the same plan" in said, said
    assert not partial.exists()
    assert [p.name for p in sorted(ck.glob("step-*"))] == ["step-20", "step-40", "step-60"]
    lines = read_log(ck / "data.jsonl")
    assert [(s["attempt"], s["from"]) for s in lines if s["event"] == "start"] == [
        (0, 0), (0, _EVERY)]
    assert [k for k, _ in effective(lines)] == list(range(_STEPS))


def test_saves_cut_short_at_any_point_are_partial_and_never_loaded(tmp_path: Path) -> None:
    whole = tmp_path / "step-10"
    whole.mkdir()
    (whole / checkpoint.MARKER).write_text('{"minibatches": 10, "files": {}}')
    renamed = tmp_path / "step-20"  # renamed from .tmp, killed before the marker
    writing = tmp_path / "step-30.tmp"  # killed while writing
    for folder in (renamed, writing):
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "data.jsonl").write_text("")
    assert checkpoint.partial(tmp_path) == [renamed, writing]
    assert checkpoint.latest(tmp_path) == whole == checkpoint.find(tmp_path)
    assert checkpoint.latest(tmp_path / "none") is None

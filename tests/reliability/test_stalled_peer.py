"""A rank stopped from outside (SIGSTOP): past ``--timeout`` every rank fails naming it;
for a moment, the run carries on and trains as if nothing happened.

The test runs ``dreampipe train`` as a command on a model whose stage-1 layer
writes its pid to a folder at its first microbatch (``ready_mlp``): that is how the
test finds the worker to stop, while it trains.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime.models_for_tests import ready_mlp
from runtime.reference import reference_sync, sgd
from torchrun import descendants

import dreampipe
from dreampipe.models.datasets import load_dataset
from dreampipe.runplan.worker_profile import profile_as_worker

__all__: list[str] = []

_TESTS = Path(__file__).resolve().parents[1]
_SRC = Path(dreampipe.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ready_mlp`` profiled as a worker computes 8 samples, the microbatch of both tests
    (``train --profile``): they check a stop, not the prediction, and start sooner."""
    path = tmp_path_factory.mktemp("ready-profile") / "ready_mlp.json"
    spec = ready_mlp(str(path.parent), layers=4, width=16)  # tells no folder: no RANK here
    profile_as_worker(spec, 8, repeats=2).save(path)
    return path


@contextlib.contextmanager
def _training(folder: Path, profile: Path, *args: str
              ) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``dreampipe train`` on ``ready_mlp`` (4 layers of 16), planned with ``profile``, with
    ``args``; yields the command and the pid of its rank 1 once that rank trains.
    Everything it started is killed on the way out, the stopped rank first."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(_SRC), str(_TESTS)])}
    cmd = [sys.executable, "-m", "dreampipe", "train", "runtime.models_for_tests:ready_mlp",
           "--model-arg", f"ready={folder}", "--model-arg", "layers=4", "--model-arg",
           "width=16", "--no-progress", "--profile", str(profile), *args]
    with (folder / "out").open("wb") as out, (folder / "err").open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
    pid: int | None = None
    try:
        mark = folder / "rank1"
        deadline = time.monotonic() + 120.0
        while not mark.is_file():
            assert proc.poll() is None, f"exit {proc.returncode}: {_read(folder, 'err')}"
            assert time.monotonic() < deadline, "rank 1 never started training"
            time.sleep(0.01)
        pid = int(mark.read_text())
        assert pid in descendants(proc.pid), "the pid written is not a worker of this command"
        yield proc, pid
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _read(folder: Path, name: str) -> str:
    return (folder / name).read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_stopped_past_the_timeout_fails_every_rank_naming_it(
    tmp_path: Path, profile: Path
) -> None:
    timeout = 4.0
    args = ("--workers", "3", "--stages", "0,2,4", "--steps", "1000", "--batch-size", "8",
            "--timeout", f"{timeout:g}")
    with _training(tmp_path, profile, *args) as (proc, pid):
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        code = proc.wait(timeout=180)
        took = time.monotonic() - stopped
    err = _read(tmp_path, "err")
    assert code == 2, err
    lines = err.splitlines()
    assert re.fullmatch(
        r"dreampipe train: error: rank 0 \(stage 0\) failed: PeerTimeoutError: rank 0 "
        r"\(stage 0\) waited more than 4 s for rank 1 \(stage 1\) in RECV_B\d+ \(minibatch "
        r"\d+\) \(.*\); check that rank's own error, or raise timeout_s \(--timeout\) if it is "
        r"only slow", lines[0],
    ), err
    assert re.fullmatch(
        r"rank 2 \(stage 2\) also failed: PeerTimeoutError: rank 2 \(stage 2\) waited more "
        r"than 4 s for rank 1 \(stage 1\) in RECV_F\d+ \(minibatch \d+\) .*", lines[1],
    ), err
    assert lines[2] == "rank 1 (stage 1) had not finished (busy, hung or stopped) and was ended"
    codes = re.search(r"exit codes by rank: \{0: (-?\d+), 1: (-?\d+), 2: (-?\d+)\}", err)
    assert codes is not None, err
    assert all(int(c) != 0 for c in codes.groups()), err
    assert took < timeout + 40.0, f"took {took:.1f} s after the stop"


@pytest.mark.slow
@pytest.mark.timing  # the stop must land in a run of well under a second: alone
@pytest.mark.timeout(240)
def test_a_rank_stopped_for_a_moment_trains_as_if_never_stopped(
    tmp_path: Path, profile: Path
) -> None:
    pause = 1.5
    args = ("--workers", "2", "--stages", "0,2", "--schedule", "1f1b-flush", "--microbatches",
            "2", "--steps", "6", "--batch-size", "16", "--timeout", "60", "--json")
    with _training(tmp_path, profile, *args) as (proc, pid):
        os.kill(pid, signal.SIGSTOP)
        time.sleep(pause)
        os.kill(pid, signal.SIGCONT)
        code = proc.wait(timeout=180)
    assert code == 0, _read(tmp_path, "err")
    got = json.loads(_read(tmp_path, "out"))
    assert got["elapsed_s"] >= pause, got  # the stop fell inside the timed training loop
    spec = ready_mlp(str(tmp_path / "unused"), layers=4, width=16)
    losses, _ = reference_sync(spec, load_dataset("synthetic", spec, seed=0), steps=6,
                               minibatch=16, seed=0, opt=sgd(0.01), microbatches=2)
    assert got["losses"] == pytest.approx(losses, rel=1e-5, abs=4e-5)

"""Kill a rank under ``torchrun --max-restarts 1``: the group restarts, resumes, loses nothing.

The test finds the worker from outside (torchrun's children in ``/proc``,
their ``RANK``) and SIGKILLs it between two checkpoints. The run must then
come back from the last committed checkpoint and end with weights bit for
bit those of a run nobody killed, and its data log must show every
minibatch trained once after the resume point: none lost, none twice.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torchrun import descendants, started, torchrun_command, worker_env

from dreampipe.api import load_model_state
from dreampipe.cli import main

from .jobs import effective, read_log, tail, train_argv, wait_for

__all__: list[str] = []

_STEPS, _EVERY = 60, 20
_KILL_AT = _EVERY + 3  # a minibatch after the first checkpoint, well before the second


@dataclass(frozen=True)
class _Kill:
    """The first attempt's workers by rank, and how long its survivors took to exit."""

    pids: dict[int, int]
    exit_s: float


def _run(tmp_path: Path, name: str, plan: tuple[str, ...], nproc: int,
         victim: int, profile: Path) -> tuple[Path, _Kill]:
    """A torchrun job in ``tmp_path/name`` whose rank ``victim`` is killed mid-run."""
    ck = tmp_path / name
    options = ["--max-restarts", "1", "--log-dir", str(tmp_path / f"{name}-logs"), "--tee", "3"]
    cmd = torchrun_command("-m", "dreampipe", *train_argv(ck, *plan, steps=_STEPS,
                                                          every=_EVERY, profile=profile),
                           nproc=nproc, options=options)
    out = tmp_path / f"{name}-torchrun"
    with started(cmd, out) as proc:
        log = ck / "data.jsonl"
        wait_for(f"minibatch {_KILL_AT} in the data log",
                 lambda: any(ln.get("minibatch", -1) >= _KILL_AT for ln in read_log(log)),
                 lambda: proc.poll() is None, 120.0)
        workers = {int(worker_env(p).get("RANK", -1)): p for p in descendants(proc.pid)
                   if worker_env(p).get("TORCHELASTIC_RESTART_COUNT") == "0"}
        assert sorted(workers) == list(range(nproc)), workers
        assert (ck / f"step-{_EVERY}" / "COMMITTED").is_file()
        os.kill(workers[victim], signal.SIGKILL)
        killed = time.monotonic()
        wait_for("the survivors' exit", lambda: not any(
            worker_env(p).get("TORCHELASTIC_RESTART_COUNT") == "0" for p in workers.values()),
            lambda: True, 60.0)
        kill = _Kill(workers, time.monotonic() - killed)
        code = proc.wait(timeout=180)
    assert code == 0, f"torchrun exit {code}\n{tail(out.with_suffix('.stderr'))}"
    return ck, kill


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("plan", "nproc", "victim"), [
    (("--config", "straight", "--stages", "0,2"), 2, 1),
    (("--config", "2-1", "--stages", "0,2"), 3, 2),
], ids=["2-stage", "2-1"])
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_loses_nothing(
    tmp_path: Path, plan: tuple[str, ...], nproc: int, victim: int,
    mlp_profile: Callable[[int], Path],
) -> None:
    ref = tmp_path / "uninterrupted"  # local workers: the same arithmetic, started faster
    assert main(train_argv(ref, *plan, steps=_STEPS, every=_EVERY, profile=mlp_profile(16))) == 0
    run, kill = _run(tmp_path, "killed", plan, nproc, victim, mlp_profile(16))

    # the survivors are out within --timeout. Each saw the lost peer at once and said so in
    # one line (a replica waiting in its all-reduce names the all-reduce), or torchrun,
    # which checks its workers every 0.1 s, stopped it first; the dead rank is named by
    # torchrun, which saw it die of SIGKILL, or by a survivor waiting on it
    agent = (tmp_path / "killed-torchrun.stderr").read_text()
    attempt0 = next((tmp_path / "killed-logs").glob("*/attempt_0"))
    named = [f"torchrun: local_rank {victim} exitcode -9"] if (
        f"exitcode: -9) local_rank: {victim} (pid: {kill.pids[victim]})" in agent) else []
    survivors = {}
    for rank in sorted(set(range(nproc)) - {victim}):
        text = (attempt0 / str(rank) / "stderr.log").read_text()
        line = next((ln for ln in text.splitlines() if ln.startswith(
            f"dreampipe train: error: rank {rank} (stage ")), None)
        if line is None:
            assert f"Sending process {kill.pids[rank]} closing signal SIGTERM" in agent, text
            assert "Traceback" not in text, text
            survivors[rank] = "stopped by torchrun before it said anything"
            continue
        assert " lost rank" in line, line
        survivors[rank] = line.split(" after ")[0].removeprefix("dreampipe train: error: ")
        if f" lost rank {victim} (stage" in line:
            named.append(f"rank {rank}")
    assert named, (survivors, agent[-3000:])
    assert kill.exit_s < 30.0  # --timeout

    # attempt 1 resumed from the last committed checkpoint, and said so
    lines = read_log(run / "data.jsonl")
    starts = [ln for ln in lines if ln["event"] == "start"]
    assert [(s["attempt"], s["from"]) for s in starts] == [(0, 0), (1, _EVERY)], starts
    killed_at = max(ln["minibatch"] for ln in lines if ln.get("attempt") == 0
                    and ln["event"] == "minibatch")
    assert _KILL_AT <= killed_at < 2 * _EVERY, killed_at
    said = (attempt0.with_name("attempt_1") / "0" / "stderr.log").read_text()
    assert f"resuming from {run / f'step-{_EVERY}'} at minibatch {_EVERY}, on the same plan" \
        in said, said[-3000:]

    # every minibatch trained once after the resume point, the same data as the reference
    trained = [ln for ln in lines if ln["event"] == "minibatch"]
    kept = effective(lines)
    assert [k for k, _ in kept] == list(range(_STEPS))
    assert kept == effective(read_log(ref / "data.jsonl"))

    # and the same weights, bit for bit
    final, expected = (load_model_state(d / f"step-{_STEPS}") for d in (run, ref))
    assert final.keys() == expected.keys()
    diff = max(float((final[k] - expected[k]).abs().max()) for k in final)
    for rank, words in survivors.items():
        print(f"\n  survivor rank {rank}: {words}", end="")
    print(f"\n  the dead rank named by: {', '.join(named)}")
    print(f"kill test {plan[1]} on {nproc} workers: killed rank {victim} at minibatch "
          f"{killed_at}, survivors out in {kill.exit_s:.1f} s; resumed at step "
          f"{starts[1]['from']}; minibatches trained {len(trained)} ({len(trained) - _STEPS} "
          f"again after the resume), each of 0..{_STEPS - 1} once in the end; "
          f"max |weights - uninterrupted| = {diff}")
    assert diff == 0.0
    assert all(torch.equal(final[k], expected[k]) for k in final)

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


def _run(tmp_path: Path, name: str, plan: tuple[str, ...], nproc: int,
         victim: int) -> tuple[Path, dict[str, float]]:
    """A torchrun job in ``tmp_path/name`` whose rank ``victim`` is killed mid-run."""
    ck = tmp_path / name
    logs = tmp_path / f"{name}-logs"
    # the agent checks its workers every 5 s, not 0.1: the survivors see the lost peer at
    # once and print their errors before it stops them (on a busy machine, at 0.1 s, the
    # agent may stop them first, and then only its own line names the dead rank)
    options = ["--max-restarts", "1", "--monitor-interval", "5", "--log-dir", str(logs),
               "--tee", "3"]
    cmd = torchrun_command("-m", "dreampipe", *train_argv(ck, *plan, steps=_STEPS,
                                                          every=_EVERY),
                           nproc=nproc, options=options)
    out = tmp_path / f"{name}-torchrun"
    facts: dict[str, float] = {}
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
        survivors = [p for r, p in workers.items() if r != victim]
        wait_for("the survivors' exit", lambda: not any(
            worker_env(p).get("TORCHELASTIC_RESTART_COUNT") == "0" for p in survivors),
            lambda: True, 60.0)
        facts["exit_s"] = time.monotonic() - killed
        facts["pid"] = workers[victim]
        code = proc.wait(timeout=180)
    assert code == 0, f"torchrun exit {code}\n{tail(out.with_suffix('.stderr'))}"
    return ck, facts


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("plan", "nproc", "victim"), [
    (("--config", "straight", "--stages", "0,2"), 2, 1),
    (("--config", "2-1", "--stages", "0,2"), 3, 2),
], ids=["2-stage", "2-1"])
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_loses_nothing(
    tmp_path: Path, plan: tuple[str, ...], nproc: int, victim: int
) -> None:
    ref = tmp_path / "uninterrupted"  # local workers: the same arithmetic, started faster
    assert main(train_argv(ref, *plan, steps=_STEPS, every=_EVERY)) == 0
    run, facts = _run(tmp_path, "killed", plan, nproc, victim)

    # torchrun saw the victim die of SIGKILL; every survivor failed at once, saying it lost
    # a peer: those waiting on the victim name it, a replica waiting in its all-reduce on
    # one of those names the all-reduce
    agent = (tmp_path / "killed-torchrun.stderr").read_text()
    assert f"exitcode: -9) local_rank: {victim} (pid: {int(facts['pid'])})" in agent, agent[-3000:]
    attempt0 = next((tmp_path / "killed-logs").glob("*/attempt_0"))
    errors = {}
    for rank in sorted(set(range(nproc)) - {victim}):
        said = (attempt0 / str(rank) / "stderr.log").read_text()
        errors[rank] = next((ln for ln in said.splitlines() if ln.startswith(
            f"dreampipe train: error: rank {rank} (stage ")), said[-3000:])
        assert " lost rank" in errors[rank], errors[rank]
    assert any(f" lost rank {victim} (stage" in line for line in errors.values()), errors
    assert facts["exit_s"] < 30.0  # --timeout

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
    for line in errors.values():
        print(f"\n  {line.split(' after ')[0]}", end="")
    print(f"\nkill test {plan[1]} on {nproc} workers: killed rank {victim} at minibatch "
          f"{killed_at}, survivors out in {facts['exit_s']:.1f} s; resumed at step "
          f"{starts[1]['from']}; minibatches trained {len(trained)} ({len(trained) - _STEPS} "
          f"again after the resume), each of 0..{_STEPS - 1} once in the end; "
          f"max |weights - uninterrupted| = {diff}")
    assert diff == 0.0
    assert all(torch.equal(final[k], expected[k]) for k in final)

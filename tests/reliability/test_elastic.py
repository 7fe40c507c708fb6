"""A group that comes back smaller re-plans for its world and resumes from the same checkpoint.

Two ways: a run on 3 workers saves and the next run has 2 (``--workers 2
--resume``); and an elastic ``torchrun --nnodes 1:2`` job, two agents on this
machine (c10d rendezvous on 127.0.0.1), loses one node to SIGKILL and the
other carries on alone.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from torchrun import descendants, started

from dreampipe.cli import main
from dreampipe.runtime.processes import free_port

from .jobs import effective, read_log, tail, train_argv, wait_for

__all__: list[str] = []

_STEPS, _EVERY = 60, 20

_DIGITS = ("--dataset", "digits", "--lr", "0.1", "--batch-size", "32")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_smaller_group_re_plans_and_carries_on_from_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
    mlp_profile: Callable[[int], Path],
) -> None:
    ck = tmp_path / "ck"
    first = train_argv(ck, "--workers", "3", "--config", "2-1", *_DIGITS, steps=30, every=10,
                       profile=mlp_profile(32))
    assert main(first) == 0, capsys.readouterr().err
    before = json.loads(capsys.readouterr().out)
    assert before["partition"] == "2-1"
    # two stages forced: for a model this small the planner may rightly find one worker
    # faster than two (it prices the host's measured all-reduce), and the group is what
    # this test shrinks; the planner still cuts the layers for the new group
    with caplog.at_level(logging.INFO, logger="dreampipe.commands.train_resume"):
        assert main(train_argv(ck, "--workers", "2", "--config", "1-1", *_DIGITS, steps=40,
                               every=10, profile=mlp_profile(32))) == 0
    captured = capsys.readouterr()
    after = json.loads(captured.out)

    # re-planned for 2 workers, resumed at step 30, and both the CLI and the log say so
    assert sum(r for _, _, r in after["stages"]) == 2
    note = (f"resuming from {ck / 'step-30'} at minibatch 30, saved by plan 2-1 (layers 0..")
    said = [ln for ln in captured.err.splitlines() if ln.startswith("resuming from")]
    assert len(said) == 1 and said[0].startswith(note), captured.err
    assert f"on 3 workers, re-planned to {after['partition']} (" in said[0], said[0]
    assert said[0].endswith("on 2 workers"), said[0]
    assert said[0] in caplog.messages, caplog.messages

    # the losses carry on from where they were, not from the initial loss
    losses = before["losses"] + after["losses"]
    assert len(after["losses"]) == 10
    first_loss, last_before, first_after = losses[0], before["losses"][-1], after["losses"][0]
    print(f"\nelastic: {said[0]}\n  loss at step 0 {first_loss:.3f}, step 29 {last_before:.3f}, "
          f"step 30 (after the re-plan) {first_after:.3f}")
    assert first_loss > 2.0  # ten digits, at chance
    assert abs(first_after - last_before) < 0.5 < first_loss - first_after
    assert [k for k, _ in effective(read_log(ck / "data.jsonl"))] == list(range(40))


def _agent(ck: Path, port: int, profile: Path, *, host: bool) -> list[str]:
    """One torchrun agent of an elastic job of 1 to 2 nodes (one process each), c10d
    rendezvous on 127.0.0.1; ``host``: this one keeps the rendezvous store."""
    conf = (f"is_host={int(host)},last_call_timeout=5,keep_alive_interval=1,"
            "keep_alive_max_attempt=3,join_timeout=120")
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "elastic", "--rdzv-conf", conf,
            "--max-restarts", "1", "-m", "dreampipe", *train_argv(ck, steps=_STEPS, every=_EVERY,
                                                            profile=profile)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_elastic_job_that_loses_a_node_re_plans_and_resumes(
    tmp_path: Path, mlp_profile: Callable[[int], Path]
) -> None:
    ck, port = tmp_path / "ck", free_port()
    log = ck / "data.jsonl"
    with started(_agent(ck, port, mlp_profile(16), host=True), tmp_path / "a") as a:
        with started(_agent(ck, port, mlp_profile(16), host=False), tmp_path / "b") as b:
            wait_for(f"minibatch {_EVERY + 3} in the data log", lambda: any(
                ln.get("minibatch", -1) >= _EVERY + 3 for ln in read_log(log)),
                lambda: a.poll() is None and b.poll() is None, 180.0)
            assert (ck / f"step-{_EVERY}" / "COMMITTED").is_file()
            node = [b.pid, *descendants(b.pid)]
            for pid in node:  # the node is gone: its agent and its worker at once
                os.kill(pid, signal.SIGKILL)
        code = a.wait(timeout=180)
    said = (tmp_path / "a.stderr").read_text()
    assert code == 0, tail(tmp_path / "a.stderr")
    lines = read_log(log)
    starts = [(s["attempt"], s["from"], s["workers"]) for s in lines if s["event"] == "start"]
    assert starts == [(0, 0, 2), (1, _EVERY, 1)], starts
    assert [k for k, _ in effective(lines)] == list(range(_STEPS))
    note = next((ln for ln in said.splitlines() if ln.startswith("resuming from")), said[-3000:])
    print(f"\nelastic torchrun --nnodes 1:2, one node killed: {note}")
    assert note.startswith(f"resuming from {ck / f'step-{_EVERY}'} at minibatch {_EVERY}, "
                           "saved by plan "), note
    assert " on 2 workers, re-planned to " in note and note.endswith(" on 1 worker"), note

"""Errors, not hangs: bad inputs fail before any send, a stalled peer fails every rank.

Runs start as ``dreampipe train`` starts them (:func:`dreampipe.commands.train_run.train_local`,
one Pipeline per local rank), or, for the Pipeline's own checks, straight
from the runtime's launcher.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import time
from typing import Any

import pytest
import torch

from dreampipe.api import Pipeline, TrainConfig
from dreampipe.commands.train_config import TrainRun
from dreampipe.commands.train_run import TrainJob, train_local
from dreampipe.errors import ConfigError, PeerTimeoutError, PlanError, ScheduleError, WorkerError
from dreampipe.models import get_model
from dreampipe.planning.plan import Plan
from dreampipe.runtime.processes import run_processes

from .runs import train_run

__all__: list[str] = []

MODEL_KW = (("layers", 4), ("width", 16))


def _run(plan: Plan, **kw: Any) -> TrainRun:
    """A run of the mlp on ``plan`` (``kw``: TrainRun and TrainConfig fields)."""
    return train_run(model="mlp", plan=plan, model_kwargs=MODEL_KW, **kw)


BAD = [
    (
        (Plan.from_config(4, [0, 2], [1, 1]), {"schedule": "1f1b-flush", "minibatch_size": 256,
                                               "microbatches": 3}),
        ConfigError,
        "minibatch_size=256 is not divisible by microbatches=3; .* split it into 4 or 8 "
        "microbatches",
    ),
    (
        (Plan.from_config(4, [0], [2]), {"schedule": "dp", "minibatch_size": 30,
                                         "microbatches": 2}),
        ConfigError,
        "minibatch_size=30 is not divisible by 2 workers x microbatches=2 = 4 microbatches",
    ),
    (
        (Plan.from_config(4, [0, 2], [1, 1]), {"microbatches": 4}),
        ConfigError, "microbatches=4 with schedule=pipedream",
    ),
    (
        (Plan.from_config(4, [0, 2], [1, 1]), {"vertical_sync": True, "stash": False}),
        ConfigError, "vertical_sync=True runs every stage on a stashed weight version, so it "
                     "needs weight stashing",
    ),
    (
        (Plan.from_config(4, [0, 2], [1, 1]), {"schedule": "gpipe", "microbatches": 2,
                                               "vertical_sync": True}),
        ConfigError, "apply to the pipedream schedule only",
    ),
    (
        (Plan.from_config(4, [0, 2], [2, 1]), {"vertical_sync": True}),
        ConfigError, "vertical_sync=True with pipedream needs every stage replicated equally "
                     "\\(got 2-1\\)",
    ),
    (
        (Plan.from_config(4, [0, 2], [1, 2]), {"vertical_sync": True}),
        ConfigError, "vertical_sync=True with pipedream needs every stage replicated equally "
                     "\\(got 1-2\\)",
    ),
    (
        (Plan.from_config(4, [0, 2], [1, 1]), {"schedule": "dp"}),
        ScheduleError, "the dp schedule runs one stage on every worker, not plan straight of 2 "
                       "stages; use a one-stage plan \\(config like '2'\\)",
    ),
    (
        (Plan.from_config(5, [0, 1, 2, 3, 4], [1] * 5), {}),
        PlanError, "5 stages but mlp has only 4 layers",
    ),
    (
        (Plan.from_config(6, [0, 3], [1, 1]), {}),
        PlanError, "model of 6 layers but mlp has 4",
    ),
    (
        (Plan.from_config(4, [0, 2], [1, 1], layer_names=("fc0", "fc1", "conv", "fc3")), {}),
        PlanError, "layer 2 is 'conv' but mlp's is 'fc2'",
    ),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("args", "error", "message"), BAD, ids=[m for _, _, m in BAD])
def test_bad_inputs_raise_before_any_process_starts(
    args: tuple[Plan, dict[str, Any]], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        train_local(TrainJob(_run(args[0], **args[1])))
    assert mp.active_children() == []


@pytest.mark.timeout(60)
def test_a_stage_that_returns_a_tuple_fails_every_rank_before_any_send() -> None:
    cfg = TrainRun(model="runtime.models_for_tests:tuple_mlp", model_kwargs=MODEL_KW,
                   plan=Plan.from_config(5, [0, 3], [1, 1]), steps=3, minibatch_size=4)
    with pytest.raises(PlanError) as info:
        train_local(TrainJob(cfg), deadline_s=50.0)
    text = str(info.value)
    assert re.search(r"stage 0 \(layers 0\.\.2\b.*\) returns a tuple, not a tensor", text), text
    assert mp.active_children() == []


def _pipeline_on(_rank: int, _world: int, plan: Plan) -> None:
    """Build a Pipeline of ``plan`` on this rank (it checks the plan against the world)."""
    spec = get_model("mlp", layers=4, width=16)
    Pipeline(spec.build(0, 3, 0), example=(spec.sample_input(8), spec.sample_target(8)),
             loss_fn=spec.loss_fn, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
             plan=plan, config=TrainConfig(timeout_s=30.0))


@pytest.mark.timeout(60)
def test_worker_count_must_match_the_plan() -> None:
    with pytest.raises(PlanError, match="uses 2 workers but 3 were started"):
        run_processes(_pipeline_on, 3, Plan.from_config(4, [0, 2], [1, 1]), deadline_s=50.0)


@pytest.mark.timeout(90)
def test_a_stalled_rank_fails_every_rank_within_the_timeout() -> None:
    timeout = 3.0
    cfg = TrainRun(
        model="runtime.models_for_tests:stall_mlp", model_kwargs=MODEL_KW,
        plan=Plan.from_config(5, [0, 2, 3], [1, 1, 1]), steps=3, minibatch_size=4,
        config=TrainConfig(timeout_s=timeout),
    )
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError) as info:
        train_local(TrainJob(cfg), deadline_s=60.0)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert re.search(
        r"rank 0 \(stage 0\) waited more than 3 s for rank 1 \(stage 1\) in RECV_B0 "
        r"\(minibatch 0\)", text,
    ), text
    assert re.search(
        r"rank 2 \(stage 2\) waited more than 3 s for rank 1 \(stage 1\) in RECV_F0 "
        r"\(minibatch 0\)", text,
    ), text
    codes = re.search(r"exit codes by rank: \{0: (-?\d+), 1: (-?\d+), 2: (-?\d+)\}", text)
    assert codes is not None, text
    assert all(int(c) != 0 for c in codes.groups())
    assert text.splitlines()[0].endswith(
        "check that rank's own error, or raise timeout_s (--timeout) if it is only slow"
    ), text
    assert "--- traceback of rank 0 ---" in text
    assert elapsed < timeout + 30.0
    assert mp.active_children() == []


@pytest.mark.timeout(90)
def test_the_failing_rank_comes_first_not_the_peers_it_left_waiting() -> None:
    cfg = TrainRun(
        model="runtime.models_for_tests:crash_mlp", model_kwargs=MODEL_KW,
        plan=Plan.from_config(5, [0, 2], [1, 1]), steps=3, minibatch_size=4,
        config=TrainConfig(timeout_s=30.0),
    )
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        train_local(TrainJob(cfg), deadline_s=60.0)
    lines = str(info.value).splitlines()
    assert lines[0] == "rank 1 (stage 1) failed: ValueError: crash layer reached", lines[0]
    left = [ln for ln in lines if ln.startswith("rank 0 (stage 0) also failed")]
    assert all("waited more than" not in ln and "lost rank 1" in ln for ln in left), left
    assert time.monotonic() - start < 30.0
    assert mp.active_children() == []


def test_a_peer_the_transport_lost_while_the_group_formed_comes_after_the_failing_rank(
) -> None:
    """Rank 1 fails at once, and rank 0's gloo set-up then loses it: gloo's own error is
    a failure that follows rank 1's, reported after it."""
    from dreampipe.runtime.processes import _failure

    class _Proc:
        exitcode = 1

    lost = ("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:57556")
    failures: dict[int, tuple[Any, str, str]] = {
        0: (None, lost, "tb0"), 1: (PlanError, "PlanError: no plan", "tb1")}
    got = _failure([_Proc(), _Proc()], failures, [], None, None)
    assert isinstance(got, PlanError)
    assert str(got).splitlines()[:2] == ["rank 1 failed: PlanError: no plan",
                                         f"rank 0 also failed: {lost}"]
    failures[0] = (None, "RuntimeError: CUDA error: out of memory", "tb0")  # its own failure
    assert str(_failure([_Proc(), _Proc()], failures, [], None, None)).startswith("rank 0 failed")

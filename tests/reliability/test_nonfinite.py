"""A NaN or inf stops the run naming the minibatch and the stage, or (skip) drops that update."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dreampipe.api import Pipeline, TrainConfig
from dreampipe.cli import main
from dreampipe.errors import ConfigError, NonFiniteError
from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset
from dreampipe.planning.plan import Plan
from dreampipe.runtime.nonfinite import NonFiniteGuard, OnNonFinite
from dreampipe.runtime.processes import run_processes
from dreampipe.scheduling.actions import Action, ActionKind, ScheduleKind
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout

__all__: list[str] = []

SEED = 5
MINIBATCH = 8


def _train(rank: int, world: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train the mlp through a Pipeline per job, in one process group, on the synthetic
    stream; minibatch ``job["nan"]`` gets a NaN, those in ``job["drop"]`` are left out."""
    dist.init_process_group("gloo")
    try:
        return [_train_one(job) for job in jobs]
    finally:
        dist.destroy_process_group()


def _train_one(job: dict[str, Any]) -> dict[str, Any]:
    spec = get_model("mlp", layers=4, width=16)
    data = load_dataset("synthetic", spec, seed=SEED)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The model's loss; a label below 0 (``job["nan_backward"]``) adds a finite 0
        whose gradient is NaN (the slope of sqrt at 0, times 0)."""
        bad = y < 0
        loss = spec.loss_fn(out, torch.where(bad, -1 - y, y))
        return loss + torch.sqrt(out.abs().sum() * 0) if bool(bad.any()) else loss

    pipe = Pipeline(
        spec.build(0, spec.num_layers - 1, SEED), example=data.batch(0, MINIBATCH),
        loss_fn=loss_fn, optimizer=lambda p: torch.optim.SGD(p, lr=0.2),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1 / (1 + k)),
        plan=Plan.from_config(spec.num_layers, job["bounds"], job["replicas"]),
        config=TrainConfig(schedule=job["schedule"], microbatches=job.get("microbatches", 1),
                           on_nonfinite=job["on_nonfinite"], timeout_s=30.0,
                           precision=job.get("precision", "fp32"),
                           max_grad_norm=job.get("max_grad_norm")),
    )
    for k in range(job["steps"]):
        if k in job.get("drop", ()):
            continue
        x, y = data.batch(k, MINIBATCH)
        if k == job.get("nan_backward"):
            y = y.clone()
            y[0] = -1 - y[0]
        if k == job.get("nan"):
            x = x.clone()
            x[MINIBATCH - 1, 0] = float("nan")
        pipe.step(x, y)
    losses = pipe.finish()
    scaler = pipe.runner.scaler
    out = {"losses": losses, "state": pipe.full_state_dict(), "skipped": pipe.skipped,
           "scale": None if scaler is None else scaler.value,
           "scheduled": None if pipe.scheduler is None else pipe.scheduler.last_epoch}
    pipe.close()
    return out


def test_the_check_sees_nan_and_inf_but_not_a_sum_that_overflows() -> None:
    layout = MicrobatchLayout(kind=ScheduleKind.FLUSH, minibatch_size=4, microbatches=2, workers=2)
    guard = NonFiniteGuard(OnNonFinite.STOP, layout.build([1, 1], 3), 0, torch.device("cpu"))
    x = torch.ones(2, 2)
    guard.check(Action(ActionKind.FORWARD, 0, 3), torch.full((2, 2), 3e38), x, False)
    with pytest.raises(NonFiniteError, match=r"^minibatch 1 \(microbatch 1 of 2\): the output "
                       r"of stage 0 \(rank 0\) is not finite \(2 of 4 values are nan or inf\); "
                       "its input was finite"):
        guard.check(Action(ActionKind.FORWARD, 0, 3),
                    torch.tensor([[1.0, float("nan")], [float("-inf"), 2.0]]), x, False)
    # a float16 output (fp16-mixed's autocast) that left float16's range says so
    with pytest.raises(NonFiniteError, match=r"in float16, whose largest value is 65504"):
        guard.check(Action(ActionKind.FORWARD, 0, 3), x.half() * 7e4, x, False)


@pytest.mark.timeout(90)
def test_a_nan_in_the_data_stops_every_rank_naming_the_minibatch_and_the_input_stage() -> None:
    with pytest.raises(NonFiniteError) as info:
        run_processes(_train, 2, [{"schedule": "pipedream", "bounds": [0, 2],
                                   "replicas": [1, 1], "steps": 6, "nan": 3,
                                   "on_nonfinite": "stop"}], deadline_s=60.0)
    first = str(info.value).splitlines()[0]
    assert first == (
        "rank 0 failed: NonFiniteError: minibatch 3: the output of stage 0 (rank 0) is not "
        "finite (16 of 128 values are nan); its input was not finite already: check "
        "minibatch 3 of the data, or skip such minibatches with on_nonfinite=skip "
        "(--on-nonfinite skip)"
    ), first
    assert "rank 1 also failed" in str(info.value)


@pytest.mark.timeout(30)
def test_skip_needs_a_synchronous_schedule() -> None:
    spec = get_model("mlp", layers=4, width=16)
    with pytest.raises(ConfigError, match="on_nonfinite=skip needs every stage to update"):
        Pipeline(spec.build(0, 3, SEED),
                 example=(spec.sample_input(MINIBATCH), spec.sample_target(MINIBATCH)),
                 loss_fn=spec.loss_fn, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                 config=TrainConfig(on_nonfinite="skip"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_skipped_minibatch_leaves_the_weights_of_a_run_that_never_saw_it() -> None:
    # dp on 2 workers: the replicas still all-reduce the skipped update's (NaN) gradient
    job = {"schedule": "dp", "bounds": [0], "replicas": [2], "steps": 5, "microbatches": 2,
           "on_nonfinite": "skip"}
    ranks = run_processes(_train, 2, [{**job, "nan": 2}, {**job, "drop": (2,)}],
                          deadline_s=90.0)
    assert [skipped["skipped"] for skipped, _ in ranks] == [[2], [2]]
    got, never = ranks[0]
    assert never["skipped"] == []
    assert math.isnan(got["losses"][2])
    assert got["losses"][:2] + got["losses"][3:] == never["losses"]
    assert sorted(got["state"]) == sorted(never["state"])
    for name, value in never["state"].items():
        assert torch.equal(got["state"][name], value), name


@pytest.mark.timeout(120)
def test_a_nan_only_a_backward_makes_stops_a_clipped_run_or_skips_its_update() -> None:
    """Every forward is finite, but minibatch 2's gradients are NaN. Their global norm is
    NaN on every rank: ``clip_grad_norm_`` would make every gradient NaN, and a clip
    coefficient of ``min(1, max_norm / nan)`` would apply them unclipped. ``skip`` drops
    the update on every stage, as if the run never saw it; ``stop`` names the cause."""
    job = {"schedule": "1f1b-flush", "bounds": [0, 2], "replicas": [1, 1], "steps": 4,
           "microbatches": 2, "on_nonfinite": "skip", "max_grad_norm": 1.0}
    ranks = run_processes(_train, 2, [{**job, "nan_backward": 2}, {**job, "drop": (2,)}],
                          deadline_s=90.0)
    got, never = ranks[0]
    assert got["skipped"] == [2] and never["skipped"] == []
    assert got["scheduled"] == never["scheduled"] == 3  # the rates of a run without it
    assert got["losses"][:2] + got["losses"][3:] == never["losses"]
    for name, value in never["state"].items():
        assert torch.equal(got["state"][name], value), name
    with pytest.raises(NonFiniteError, match="minibatch 2: the gradients' global norm is nan"):
        run_processes(_train, 2, [{**job, "nan_backward": 2, "on_nonfinite": "stop"}],
                      deadline_s=60.0)


@pytest.mark.timeout(120)
def test_a_skipped_fp16_update_halves_the_loss_scale_as_a_gradscaler_does() -> None:
    """A NaN in a minibatch's forward makes its gradients NaN too: a GradScaler skips that
    update and halves its scale, and so does every rank here (and grows it back only
    after its window of finite updates)."""
    job = {"schedule": "1f1b-flush", "bounds": [0, 2], "replicas": [1, 1], "steps": 4,
           "microbatches": 2, "on_nonfinite": "skip", "precision": "fp16-mixed", "nan": 1}
    ranks = run_processes(_train, 2, [job], deadline_s=90.0)
    for (got,) in ranks:
        assert got["skipped"] == [1]
        assert got["scale"] == 2.0**15  # the initial 2**16, halved; its window is 2000
        assert got["scheduled"] == 3  # the scheduler steps with the 3 updates made only


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_train_stops_at_an_inf_a_stage_makes_or_skips_it(
    capfd: pytest.CaptureFixture[str],
) -> None:
    base = ["train", "runtime.models_for_tests:inf_mlp", "--model-arg", "layers=4",
            "--model-arg", "width=16", "--workers", "2", "--stages", "0,2", "--steps", "6",
            "--batch-size", "8", "--no-progress", "--timeout", "30"]
    assert main([*base, "--model-arg", "at=3"]) == 2
    err = capfd.readouterr().err  # after the convergence study's warning on pipedream
    error = next((ln for ln in err.splitlines() if ln.startswith("dreampipe train: error:")), "")
    assert error.startswith(
        "dreampipe train: error: rank 1 (stage 1) failed: NonFiniteError: minibatch 3: the "
        "loss of stage 1 (rank 1) is not finite (1 of 1 values are nan); its input was "
        "finite, so the layers of stage 1 made it"
    ), err
    # two microbatches a minibatch: the 7th microbatch is minibatch 3's second
    argv = [*base, "--model-arg", "at=7", "--schedule", "1f1b-flush", "--microbatches", "2",
            "--on-nonfinite", "skip", "--json"]
    assert main(argv) == 0
    out, err = capfd.readouterr()
    assert "skipped minibatch 3: a non-finite value first appeared at stage 1" in err, err
    losses = json.loads(out)["losses"]
    assert [math.isnan(v) for v in losses] == [False, False, False, True, False, False]

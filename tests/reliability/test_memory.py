"""Each rank's peak memory in ``dreampipe train`` is within 15% of the planner's prediction
(a quarter where an Adam stage predicts its weights).

Two local ranks, two stages, PipeDream's schedule with and without weight
stashing, on an mlp whose weights dominate (about 50 MB a stage) and a cnn
whose conv activations do (what autograd keeps of a conv block is 7 times
its output). The measured figure is the peak of the rank's tensors
(:mod:`dreampipe.runtime.memory_meter`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dreampipe.api import TrainConfig
from dreampipe.commands.train_config import TrainOptions
from dreampipe.commands.train_plan import PlanSource, TrainRequest
from dreampipe.commands.train_run import run_train
from dreampipe.errors import ConfigError
from dreampipe.models import get_model
from dreampipe.runplan.worker_profile import profile_as_worker
from dreampipe.runtime.runner_options import OptimizerKind

_MODELS = {
    "mlp": (("width", 2048), ("layers", 8)),
    "cnn": (("hidden", 2048),),
}
_CUTS = {"mlp": "0,4", "cnn": "0,2"}
_BATCH = {"mlp": 16, "cnn": 256}


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each model profiled once at its minibatch, a pipedream microbatch (``train --profile``):
    the sizes memory is predicted from are those a run's own profile measures, which
    one case still takes, as ``train`` does by default."""
    folder = tmp_path_factory.mktemp("memory-profiles")
    for model, kwargs in _MODELS.items():
        profile_as_worker(get_model(model, **dict(kwargs)), _BATCH[model], repeats=1).save(
            folder / f"{model}.json")
    return {model: folder / f"{model}.json" for model in _MODELS}


def _request(model: str, stash: bool, profile: Path | None, memory_bytes: int | None = None,
             optimizer: OptimizerKind = OptimizerKind.SGD) -> TrainRequest:
    run = TrainOptions(model=model, model_kwargs=_MODELS[model], minibatch_size=_BATCH[model],
                       steps=4, config=TrainConfig(stash=stash, timeout_s=120.0,
                                                   measure_memory=True),
                       progress=False, optimizer=optimizer)
    return TrainRequest(run=run, plan=PlanSource(config="straight", stages=_CUTS[model]),
                        workers=2, exact_steps=True, memory_bytes=memory_bytes,
                        profile=None if profile is None else str(profile))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("model", "stash", "saved"), [
    ("mlp", True, False), ("mlp", False, True), ("cnn", True, True), ("cnn", False, True),
], ids=["mlp-stash-own-profile", "mlp-no-stash", "cnn-stash", "cnn-no-stash"])
def test_peak_memory_is_within_15_percent_of_the_prediction(
    model: str, stash: bool, saved: bool, profiles: dict[str, Path]
) -> None:
    report = run_train(_request(model, stash, profiles[model] if saved else None))
    assert report is not None
    rows = report.memory_rows()
    assert [r["stage"] for r in rows] == [0, 1]
    for r in rows:
        assert r["predicted_bytes"] > 20e6, r  # the model's memory dominates the noise
        assert 0.85 <= r["ratio"] <= 1.15, rows


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_adam_stage_that_predicts_its_weights_is_within_a_quarter_of_the_prediction(
    profiles: dict[str, Path]
) -> None:
    """Adam's delayed stage runs on predicted weights: two more copies of them, counted."""
    report = run_train(_request("mlp", True, profiles["mlp"], optimizer=OptimizerKind.ADAM))
    assert report is not None
    rows = report.memory_rows()
    for r in rows:
        assert 0.75 <= r["ratio"] <= 1.25, rows  # it reads 1.16
    weights = 4 * 2048 * 2048 * 4  # stage 0's: four 2048x2048 float32 layers of the mlp's 8
    assert rows[0]["predicted_bytes"] - rows[1]["predicted_bytes"] > 1.5 * weights, rows


def test_memory_that_no_stage_fits_is_an_error_before_training(
    profiles: dict[str, Path]
) -> None:
    with pytest.raises(ConfigError, match=r"stage 0 \(layers 0..3\) needs about .* MB"):
        run_train(_request("mlp", True, profiles["mlp"], memory_bytes=10**6))


def _wide_mlp(layers: int, workers: int, stages: str | None, config: TrainConfig,
              optimizer: OptimizerKind = OptimizerKind.SGD,
              replicas: str = "straight") -> list[dict[str, Any]]:
    """Each rank's memory row of ``dreampipe train`` on an mlp of 1024-wide layers, whose
    weights outweigh its activations, in a pipeline of ``replicas`` (a config) cut at
    ``stages``."""
    run = TrainOptions(
        model="mlp", model_kwargs=(("width", 1024), ("layers", layers)), minibatch_size=12,
        steps=4, optimizer=optimizer, lr=1e-3,
        config=dataclasses.replace(config, timeout_s=120.0, measure_memory=True),
        progress=False)
    report = run_train(TrainRequest(run=run, plan=PlanSource(config=replicas, stages=stages),
                                    workers=workers, exact_steps=True))
    assert report is not None
    rows: list[dict[str, Any]] = report.memory_rows()
    return rows


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_vertical_sync_keeps_the_live_weights_beside_the_versions_ahead() -> None:
    """Under vertical sync stage ``s`` keeps ``s`` versions beside those of its microbatches
    in flight, and, after the first stage, the live weights beside them: a copy of the
    stage's weights that the prediction left out (1.24 to 1.32 of it on later stages)."""
    rows = _wide_mlp(6, 3, "0,2,4", TrainConfig(schedule="pipedream", vertical_sync=True))
    assert [r["stage"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert 0.85 <= r["ratio"] <= 1.15, rows


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_replicated_stage_sums_its_large_gradients_in_place() -> None:
    """Stage 0 (two 1024x1024 layers, 8.4 MB of weights) alone and on 2 replicas: the
    replicas' all-reduce adds only the biases' packed copy to the peak, not a copy of
    every gradient as packing all of them did (8.4 MB more), and the prediction
    counts that."""
    config = TrainConfig(schedule="1f1b-flush", microbatches=2)
    alone = _wide_mlp(4, 2, "0,2", config)[0]
    replicated = _wide_mlp(4, 3, "0,2", config, replicas="2-1")
    assert [r["stage"] for r in replicated] == [0, 0, 1]
    weights = 2 * 1024 * 1024 * 4
    for r in replicated[:2]:
        assert r["measured_bytes"] - alone["measured_bytes"] < weights / 8, (r, alone)
        assert 0.85 <= r["ratio"] <= 1.15, replicated


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_interleaved_rank_holds_its_own_stages_and_no_other_layer() -> None:
    """Interleaved 1F1B on 3 ranks, 2 stages each, far apart (stage s on rank s mod 3): each
    rank builds and keeps only its two stages' weights, so its peak is the sum of theirs,
    less what the rank never holds at once, within 15%. A rank that kept the whole model
    would hold three times its weights."""
    rows = _wide_mlp(6, 3, None, TrainConfig(schedule="interleaved-1f1b", virtual_stages=2,
                                             microbatches=3))
    assert [r["rank"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["predicted_bytes"] > 8e6, r  # a 1024x1024 layer and its gradient at least
        assert 0.85 <= r["ratio"] <= 1.15, rows


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_2bw_stage_holds_its_two_weight_versions() -> None:
    """PipeDream-2BW runs a minibatch on the weights before the live ones: once an update
    has run, every stage holds two copies of its weights, and the prediction counts both;
    a step lets the version before them go (a third copy held to the next forward read
    1.29 and 1.32)."""
    rows = _wide_mlp(4, 2, "0,2", TrainConfig(schedule="2bw", microbatches=2))
    for r in rows:
        assert r["predicted_bytes"] > 12e6, r  # 1024x1024 weights, twice, their gradient
        assert 0.85 <= r["ratio"] <= 1.15, rows


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("schedule", "precision"), [
    ("1f1b-flush", "fp32"), ("2bw", "fp32"), ("1f1b-flush", "bf16")])
def test_adams_step_temporaries_are_counted_where_the_weights_dominate(
        schedule: str, precision: str) -> None:
    """On stages of 1024x1024 layers, Adam's state and its step's temporaries (two the
    size of a layer, one of the last: :mod:`dreampipe.runtime.optimizer_step`; with 16-bit
    weights, over their 32-bit masters, stepped with 32-bit copies of the gradients)
    outweigh the activations; without them the prediction read 1.16 to 1.47 of the peak."""
    rows = _wide_mlp(4, 2, "0,2", TrainConfig(schedule=schedule, microbatches=2,
                                              precision=precision), OptimizerKind.ADAM)
    for r in rows:
        assert r["predicted_bytes"] > 20e6, r  # a 1024x1024 layer, Adam's two copies, more
        assert 0.85 <= r["ratio"] <= 1.15, rows


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_plan_under_adam_holds_within_the_limit_it_was_made_for() -> None:
    """Eight 1024-wide layers (25.5 MB of weights) with Adam on 2 workers within 60 MB:
    with its two copies of state no layer pipeline fits (the planner counts them), so every
    layer is split over both workers; their step's temporaries are counted too, so the
    prediction is not short of what a worker holds."""
    run = TrainOptions(
        model="mlp", model_kwargs=(("width", 1024), ("layers", 8)), minibatch_size=16,
        steps=4, optimizer=OptimizerKind.ADAM, lr=1e-3,
        config=TrainConfig(schedule="1f1b-flush", timeout_s=120.0, measure_memory=True),
        progress=False)
    limit = 60_000_000
    report = run_train(TrainRequest(run=run, plan=PlanSource(), workers=2, exact_steps=True,
                                    memory_bytes=limit))
    assert report is not None
    rows = report.memory_rows()
    assert report.plan.has_splits, report.plan
    for r in rows:
        assert r["measured_bytes"] <= r["predicted_bytes"] <= limit, rows
        assert r["ratio"] >= 0.85, rows


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("microbatches", [1, 2])
def test_autocasts_16_bit_weight_gradients_are_counted(microbatches: int) -> None:
    """Under bf16 autocast a 1024x1024 layer's weight gradient is made in 16 bits and cast
    to 32 before it joins the update's sum: half a layer beside the sum for one microbatch
    an update, a whole 32-bit layer for more (they read 1.20 to 1.39 uncounted)."""
    rows = _wide_mlp(4, 2, "0,2", TrainConfig(schedule="1f1b-flush",
                                              microbatches=microbatches,
                                              precision="bf16-mixed"))
    for r in rows:
        assert r["predicted_bytes"] > 8e6, r
        assert 0.85 <= r["ratio"] <= 1.15, rows

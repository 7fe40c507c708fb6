"""``commands.train_run``: where a job saves, what its report says, and a small local run of
the mlp on 2 workers that must train as one process does."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

import dreampipe.commands.train_run as train_run
from dreampipe.api.config import TrainConfig
from dreampipe.commands.train_config import TrainResult, TrainRun
from dreampipe.commands.train_run import Checkpoints, TrainJob, TrainReport, train_local
from dreampipe.errors import ConfigError, PlanError
from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset
from dreampipe.planning.plan import Plan
from dreampipe.runtime.memory_meter import MemoryUse
from dreampipe.scheduling.actions import ActionKind

__all__: list[str] = []

_KWARGS = (("layers", 4), ("width", 32))
SPEC = get_model("mlp", **dict(_KWARGS))


# ---- Checkpoints and TrainJob ---------------------------------------------------------------

@pytest.mark.parametrize(("kw", "named", "needle"), [
    ({"every": 4}, ("checkpoint_every", "checkpoint_dir"), "checkpoint_every=4 needs "
                                                           "checkpoint_dir=DIR"),
    ({"resume": True}, ("resume", "checkpoint_dir"), "resume=True needs checkpoint_dir=DIR"),
    ({"directory": Path("ck"), "every": 0}, ("checkpoint_every",), "checkpoint_every=0; use 1"),
], ids=["every-without-dir", "resume-without-dir", "every-0"])
def test_checkpoints_refuse_what_they_cannot_do(kw: dict[str, Any], named: tuple[str, ...],
                                               needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        Checkpoints(**kw)
    assert info.value.parameters == named
    assert needle in str(info.value)


def test_checkpoints_and_jobs_default_to_no_saving_and_a_fresh_start(tmp_path: Path) -> None:
    Checkpoints(directory=tmp_path, every=1, resume=True, data_log=tmp_path / "log")
    Checkpoints(directory=tmp_path)
    job = TrainJob(_run(_plan()))
    assert job.checkpoints == Checkpoints() and job.resume_from is None
    none = job.checkpoints
    assert (none.directory, none.every, none.resume, none.data_log) == (None, None, False, None)


# ---- TrainReport -----------------------------------------------------------------------------

def _plan(replicas: tuple[int, int] = (1, 1)) -> Plan:
    return Plan.from_config(SPEC.num_layers, [0, 3], list(replicas), model=SPEC.name,
                            layer_names=tuple(SPEC.layer_names))


def _run(plan: Plan, **kw: Any) -> TrainRun:
    return TrainRun(model="mlp", model_kwargs=_KWARGS, plan=plan, **kw)


def _result(memory: tuple[MemoryUse, ...] = (), accuracy: float | None = None) -> TrainResult:
    return TrainResult(samples_per_s=250.0, final_loss=0.5, losses=(0.9, 0.7, 0.5),
                       accuracy=accuracy, events=(), elapsed_s=1.5, stage_states=({}, {}),
                       memory=memory)


_MEMORY = (MemoryUse(0, 0, 1000, 5000, "cpu"), MemoryUse(1, 0, 2000, 4000, "cpu"),
           MemoryUse(2, 1, 500, 3500, "cpu"))


def test_memory_rows_set_each_ranks_measured_bytes_beside_its_stages_prediction() -> None:
    report = TrainReport(_plan((2, 1)), 3, 100.0, _result(_MEMORY), predicted_memory=(8000, 0))
    rows = report.memory_rows()
    assert [(r["rank"], r["stage"], r["device"]) for r in rows] == [(0, 0, "cpu"), (1, 0, "cpu"),
                                                                      (2, 1, "cpu")]
    assert [r["measured_bytes"] for r in rows] == [4000, 2000, 3000], "peak less baseline"
    assert [(r["baseline_bytes"], r["peak_bytes"]) for r in rows] == [(1000, 5000), (2000, 4000),
                                                                      (500, 3500)]
    assert [r["predicted_bytes"] for r in rows] == [8000, 8000, 0]
    assert [r["ratio"] for r in rows] == [0.5, 0.25, None], "no ratio to a zero prediction"
    unpredicted = TrainReport(_plan((2, 1)), 3, 100.0, _result(_MEMORY)).memory_rows()
    assert [(r["predicted_bytes"], r["ratio"]) for r in unpredicted] == [(None, None)] * 3
    assert TrainReport(_plan(), 3, 100.0, _result()).memory_rows() == []


def test_an_interleaved_rank_s_row_sums_the_predictions_of_its_stages() -> None:
    plan = Plan.from_config(4, [0, 1, 2, 3], [1, 1, 1, 1], virtual_stages=2)
    uses = (MemoryUse(0, 0, 0, 9000, "cpu"), MemoryUse(1, 1, 0, 7000, "cpu"))
    rows = TrainReport(plan, 3, 100.0, _result(uses),
                       predicted_memory=(1000, 2000, 3000, 4000)).memory_rows()
    assert [r["predicted_bytes"] for r in rows] == [1000 + 3000, 2000 + 4000]
    less = TrainReport(plan, 3, 100.0, _result(uses), predicted_memory=(1000, 2000, 3000, 4000),
                       counted_twice=(500, 700)).memory_rows()
    assert [r["predicted_bytes"] for r in less] == [4000 - 500, 6000 - 700]
    # a rank of one stage has nothing counted twice, whatever the ranks beyond the schedule's
    one = TrainReport(_plan((2, 1)), 3, 100.0, _result(_MEMORY), predicted_memory=(8000, 0),
                      counted_twice=(0,)).memory_rows()
    assert [r["predicted_bytes"] for r in one] == [8000, 8000, 0]


def test_the_summary_says_what_ran_what_was_predicted_and_what_was_measured() -> None:
    config = TrainConfig(schedule="1f1b-flush", microbatches=4, seed=2, virtual_stages=1)
    report = TrainReport(_plan((2, 1)), 3, 180.0, _result(_MEMORY, accuracy=0.75),
                         predicted_memory=(8000, 6000), config=config)
    data = json.loads(json.dumps(report.summary()))
    assert data == report.summary(), "plain JSON"
    assert (data["samples_per_s"], data["predicted_samples_per_s"]) == (250.0, 180.0)
    assert (data["final_loss"], data["losses"], data["elapsed_s"]) == (0.5, [0.9, 0.7, 0.5], 1.5)
    assert (data["steps"], data["schedule"], data["microbatches"]) == (3, "1f1b-flush", 4)
    assert data["steps_trained"] == len(data["losses"])  # fewer than steps after a resume
    assert (data["partition"], data["virtual_stages"]) == ("2-1", 1)
    assert data["stages"] == [[0, 2, 2], [3, 3, 1]]
    assert data["memory"] == json.loads(json.dumps(report.memory_rows()))
    assert TrainConfig.from_dict(data["config"]) == config
    assert data["accuracy"] == 0.75
    assert "accuracy" not in TrainReport(_plan(), 3, 1.0, _result()).summary(), (
        "no accuracy where the data set has no test split")


def test_the_summary_times_steps_of_a_new_length_against_a_repeated_one() -> None:
    result = dataclasses.replace(_result(), lengths=(5, 6, 5, 7, 6, 6),
                                 step_s=(9.0, 0.4, 0.2, 0.6, 0.1, 0.3))
    data = TrainReport(_plan(), 6, 1.0, result).summary()
    assert data["seq_lengths"] == {  # the first step, 5 tokens, counts in neither
        "new_length_step_s": 0.5, "repeated_length_step_s": 0.2, "new_length_steps": 2,
        "repeated_length_steps": 3, "lengths": [5, 6, 5, 7, 6, 6]}
    assert "seq_lengths" not in TrainReport(_plan(), 3, 1.0, _result()).summary()


# ---- train_local -------------------------------------------------------------------------

def test_a_bad_run_fails_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_processes(*_: object, **__: object) -> None:
        raise AssertionError("started processes for a run that cannot train")

    monkeypatch.setattr(train_run, "run_processes", no_processes)
    wrong = Plan.from_config(6, [0, 3], [1, 1])
    with pytest.raises(PlanError, match="plan again for this model"):
        train_local(TrainJob(_run(wrong)))
    with pytest.raises(ConfigError, match="steps=0"):
        train_local(TrainJob(_run(_plan(), steps=0)))


def test_a_failing_rank_is_raised_as_its_own_error_naming_its_stage() -> None:
    with pytest.raises(ConfigError) as info:
        train_local(TrainJob(_run(_plan(), dataset="mnist")), deadline_s=60)
    text = str(info.value)
    assert text.startswith("rank 0 (stage 0) failed: ConfigError: the mnist dataset needs "
                           "data_dir=DIR"), text
    assert "rank 1 (stage 1) also failed" in text
    assert "--- traceback of rank 0 ---" in text and "--- traceback of rank 1 ---" in text
    assert multiprocessing.active_children() == []


def test_two_workers_train_the_mlp_as_one_process_does() -> None:
    """1F1B with a flush is synchronous: the same losses and final weights as plain SGD."""
    steps, minibatch, seed = 3, 16, 3
    run = _run(_plan(), config=TrainConfig(schedule="1f1b-flush", microbatches=2, seed=seed,
                                           record_events=True),
               minibatch_size=minibatch, steps=steps, lr=0.05, momentum=0.9)
    result = train_local(TrainJob(run), deadline_s=90)

    data = load_dataset("synthetic", SPEC, seed=seed)
    model = SPEC.build(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for k in range(steps):
        x, y = data.batch(k, minibatch)
        loss = SPEC.loss_fn(model(x), y)
        opt.zero_grad()
        torch.autograd.backward(loss)
        opt.step()
        losses.append(loss.item())

    assert result.losses == pytest.approx(losses, rel=1e-5)
    assert result.final_loss == result.losses[-1]
    trained = {k: v for state in result.stage_states for k, v in state.items()}
    assert trained.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert result.accuracy is None, "the synthetic data has no test split"
    assert result.samples_per_s == pytest.approx(steps * minibatch / result.elapsed_s)
    assert {(e.rank, e.stage) for e in result.events} == {(0, 0), (1, 1)}
    forwards = [e.rank for e in result.events if e.kind is ActionKind.FORWARD]
    assert sorted(forwards) == [0] * (steps * 2) + [1] * (steps * 2), "2 microbatches a step"
    assert multiprocessing.active_children() == []

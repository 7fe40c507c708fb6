"""What ``dreampipe train --json`` reports of a run
(:class:`~dreampipe.commands.train_run.TrainReport`)."""

from __future__ import annotations

import json

import pytest

from dreampipe.api import TrainConfig
from dreampipe.commands.train_config import TrainResult
from dreampipe.commands.train_run import TrainReport
from dreampipe.planning.plan import Plan
from dreampipe.runtime.memory import MemoryUse

__all__: list[str] = []


def _report(predicted_memory: tuple[int, ...], accuracy: float | None) -> TrainReport:
    memory = (MemoryUse(0, 0, 100, 400, "cpu"), MemoryUse(1, 0, 100, 300, "cpu"),
              MemoryUse(2, 1, 50, 250, "cpu"))
    result = TrainResult(samples_per_s=120.0, final_loss=0.5, losses=(0.9, 0.7, 0.5),
                         accuracy=accuracy, events=(), elapsed_s=2.0, stage_states=(),
                         memory=memory)
    plan = Plan.from_config(4, [0, 2], [2, 1], model="mlp")
    config = TrainConfig(schedule="1f1b-flush", microbatches=2)
    return TrainReport(plan, 3, 150.0, result, predicted_memory, config)


def test_the_summary_says_what_ran_and_round_trips_through_json() -> None:
    summary = _report((250, 200), 0.75).summary()
    assert json.loads(json.dumps(summary)) == summary
    assert summary["schedule"] == "1f1b-flush" and summary["microbatches"] == 2
    assert summary["partition"] == "2-1" and summary["stages"] == [[0, 1, 2], [2, 3, 1]]
    assert summary["losses"] == [0.9, 0.7, 0.5] and summary["final_loss"] == 0.5
    assert summary["config"] == TrainConfig(schedule="1f1b-flush", microbatches=2).to_dict()
    assert summary["accuracy"] == 0.75
    assert "accuracy" not in _report((250, 200), None).summary()


def test_each_ranks_memory_sits_beside_its_stages_prediction() -> None:
    rows = _report((250, 200), None).memory_rows()
    assert [(r["rank"], r["stage"], r["measured_bytes"], r["predicted_bytes"]) for r in rows] \
        == [(0, 0, 300, 250), (1, 0, 200, 250), (2, 1, 200, 200)]
    assert [r["ratio"] for r in rows] == pytest.approx([1.2, 0.8, 1.0])
    unpredicted = _report((), None).memory_rows()
    assert all(r["predicted_bytes"] is None and r["ratio"] is None for r in unpredicted)

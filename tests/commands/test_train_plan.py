"""``dreampipe train``'s plan: checks before profiling, then the one plan choice
(:mod:`dreampipe.commands.train_plan`), on a profile stood in for the real one."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dreampipe.api import TrainConfig
from dreampipe.commands import train_plan
from dreampipe.commands.train_config import TrainOptions
from dreampipe.commands.train_plan import PlanSource, TrainRequest, plan_train
from dreampipe.errors import ConfigError
from dreampipe.models import get_model
from dreampipe.planning.plan import Plan
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.runplan.schedule_choice import CANDIDATES, Semantics
from dreampipe.scheduling.actions import ScheduleKind

__all__: list[str] = []

_KWARGS = (("layers", 4), ("width", 16))
_RUN = TrainOptions(model="mlp", model_kwargs=_KWARGS, steps=4, minibatch_size=16)


@pytest.fixture
def profiled(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Profiles become a 4-layer graph at the asked batch, its times in proportion to it (no
    fixed part a call); returns the batches asked."""
    asked: list[int] = []

    def fake(_spec: object, batch: int, **_: Any) -> LayerGraph:
        asked.append(batch)
        layers = tuple(Layer(f"fc{i}", batch / 16, batch / 8, 4 * 16 * batch, 1 << 12)
                       for i in range(4))
        return LayerGraph(layers, tuple((i, i + 1) for i in range(3)), batch, "mlp")

    monkeypatch.setattr(train_plan, "profile_as_worker", fake)
    return asked


def test_forced_stages_are_run_as_given_and_predicted(profiled: list[int]) -> None:
    said: list[str] = []
    got = plan_train(TrainRequest(run=_RUN, plan=PlanSource(stages="0,1"), workers=2),
                     say=said.append)
    assert [(st.first, st.last, st.replicas) for st in got.run.plan.stages] == [(0, 0, 1),
                                                                                 (1, 3, 1)]
    assert profiled == [16]  # pipedream: a microbatch is the minibatch
    assert got.predicted_samples_per_s > 0 and len(got.predicted_memory) == 2
    assert any(line.startswith("predicted:") for line in said)


def test_data_parallelism_is_one_stage_on_every_worker(profiled: list[int]) -> None:
    run = dataclasses.replace(_RUN, config=TrainConfig(schedule="dp", microbatches=2))
    got = plan_train(TrainRequest(run=run, workers=2))
    assert [(st.first, st.last, st.replicas) for st in got.run.plan.stages] == [(0, 3, 2)]
    assert profiled == [4]  # 16 samples over 2 workers x 2 microbatches


def test_schedule_auto_chooses_a_schedule_of_its_semantics(profiled: list[int]) -> None:
    said: list[str] = []
    run = dataclasses.replace(_RUN, config=TrainConfig(schedule="auto", microbatches=4))
    got = plan_train(TrainRequest(run=run, workers=2), say=said.append)
    assert ScheduleKind(got.run.config.schedule) in CANDIDATES[Semantics.SYNC]
    assert got.run.config.microbatches == 4
    assert any(line.startswith("plan auto (sync)") for line in said)
    assert any(line.startswith("schedule auto (sync)") for line in said)


def test_schedule_auto_without_microbatches_predicts_from_the_microbatch_it_chose(
        profiled: list[int]) -> None:
    """Left out, the microbatches are the search's (in proportion, the most it tries: 4 a
    stage on one of 2 replicas, a round of both): the run profiles its minibatch and the
    smallest microbatch a choice prices (16 over 4 a stage on 2 workers) to choose, then the
    chosen microbatch, whose figures its memory and rate predictions read."""
    said: list[str] = []
    run = dataclasses.replace(_RUN, config=TrainConfig(schedule="auto"))
    got = plan_train(TrainRequest(run=run, workers=2), say=said.append)
    per = got.run.config.microbatches
    assert per is not None and per > 1
    size = 16 // per // (2 if got.run.config.schedule == "dp" else 1)
    assert profiled == [16, 2, size]
    assert f"profiling again at the chosen microbatch of {size} samples" in said


def test_forced_stages_or_a_v_s_config_with_virtual_stages_are_refused_before_profiling(
    profiled: list[int]
) -> None:
    run = dataclasses.replace(_RUN, config=TrainConfig(schedule="interleaved-1f1b",
                                                       microbatches=2, virtual_stages=2))
    with pytest.raises(ConfigError, match="leave out stages='0,2'"):
        plan_train(TrainRequest(run=run, plan=PlanSource(stages="0,2"), workers=2))
    v_shape = dataclasses.replace(_RUN, config=TrainConfig(schedule="zbv", microbatches=2,
                                                           virtual_stages=2))
    with pytest.raises(ConfigError, match="the V places its stages otherwise"):
        plan_train(TrainRequest(run=v_shape, plan=PlanSource(config="2"), workers=2))
    assert profiled == []


def test_steps_round_up_to_whole_rounds_unless_asked_exactly(profiled: list[int]) -> None:
    run = dataclasses.replace(_RUN, steps=3)
    said: list[str] = []
    got = plan_train(TrainRequest(run=run, plan=PlanSource(config="2"), workers=2),
                     say=said.append)
    assert got.run.steps == 4 and any("rounded up to 4" in line for line in said)
    with pytest.raises(ConfigError, match="use steps=4"):
        plan_train(TrainRequest(run=run, plan=PlanSource(config="2"), workers=2,
                                exact_steps=True))


def test_a_plan_file_with_a_partition_is_refused() -> None:
    with pytest.raises(ConfigError, match="give a plan file or a partition, not both"):
        PlanSource(path="p.json", stages="0,2")
    assert PlanSource().planner_chooses and PlanSource(config="2-1").planner_chooses
    assert not PlanSource(stages="0,2").planner_chooses
    assert not PlanSource(path="p.json").planner_chooses


def test_the_workers_default_to_the_forced_configs_total(profiled: list[int]) -> None:
    got = plan_train(TrainRequest(run=_RUN, plan=PlanSource(config="2-1")))
    assert got.run.workers == 3
    assert plan_train(TrainRequest(run=_RUN)).run.plan.workers_used <= 2


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_a_plan_file_is_read_by_every_rank_not_shared(
    profiled: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    """Every rank can read a plan file (or forced stages) alone: no exchange, so a launcher
    without torchrun's agent store runs it too."""
    def no_sharing(*_: object, **__: object) -> None:
        raise AssertionError("shared a plan every rank reads alone")

    monkeypatch.setattr(train_plan, "share_plan", no_sharing)
    path = tmp_path / "plan.json"
    spec = get_model("mlp", **dict(_KWARGS))
    Plan.from_config(4, [0, 2], [1, 1], model="mlp",
                     layer_names=tuple(spec.layer_names)).save(path)
    for source in (PlanSource(path=str(path)), PlanSource(stages="0,2")):
        got = plan_train(TrainRequest(run=_RUN, plan=source), torchrun=(rank, 2))
        assert [(st.first, st.last) for st in got.run.plan.stages] == [(0, 1), (2, 3)]

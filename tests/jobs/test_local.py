"""A saved profile in place of a fresh one: ``saved_profile`` and ``train --profile``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dreampipe.errors import ProfileError
from dreampipe.jobs import local, train
from dreampipe.jobs.local import predict_samples_per_s, saved_profile
from dreampipe.jobs.train import PlanSource, TrainRequest, plan_train
from dreampipe.models import get_model
from dreampipe.profiling.profiler import profile_spec
from dreampipe.runtime.config import RunOptions
from dreampipe.scheduling.actions import ScheduleKind

_KWARGS = (("layers", 4), ("width", 32))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 4-layer mlp of width 32, profiled at 16 samples and saved."""
    path = tmp_path_factory.mktemp("profile") / "mlp.json"
    profile_spec(get_model("mlp", **dict(_KWARGS)), batch_size=16, repeats=2).save(path)
    return path


def test_a_saved_profile_of_the_same_model_loads_as_saved(saved: Path) -> None:
    graph = saved_profile(saved, get_model("mlp", **dict(_KWARGS)))
    assert graph.batch_size == 16
    assert [layer.name for layer in graph.layers] == ["fc0", "fc1", "fc2", "fc3"]


@pytest.mark.parametrize(("kwargs", "needles"), [
    ({"layers": 4, "width": 64}, ("layer fc0 holds", "profiled at another size", "--model-arg")),
    ({"layers": 6, "width": 32}, ("with 4 layers", "not mlp with 6", "dreampipe profile mlp")),
], ids=["other-width", "other-depth"])
def test_a_profile_of_the_model_at_another_size_is_refused_naming_the_difference(
    saved: Path, kwargs: dict[str, int], needles: tuple[str, ...]
) -> None:
    with pytest.raises(ProfileError) as err:
        saved_profile(saved, get_model("mlp", **kwargs))
    assert str(saved) in str(err.value)
    for needle in needles:
        assert needle in str(err.value)


def test_a_profile_without_its_batch_size_is_refused(saved: Path, tmp_path: Path) -> None:
    from dreampipe.profiling.load import load_graph

    path = tmp_path / "unsized.json"
    dataclasses.replace(load_graph(saved), batch_size=0).save(path)
    with pytest.raises(ProfileError, match=r"batch size.*--batch-size N"):
        saved_profile(path, get_model("mlp", **dict(_KWARGS)))


def test_train_with_a_saved_profile_plans_and_predicts_with_it_without_profiling(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_profiling(*_: object, **__: object) -> None:
        raise AssertionError("profiled although a profile was given")

    monkeypatch.setattr(train, "profile_as_worker", no_profiling)
    monkeypatch.setattr(local, "profile_as_worker", no_profiling)
    run = RunOptions(model="mlp", model_kwargs=_KWARGS, schedule=ScheduleKind.FLUSH,
                     minibatch_size=16, microbatches=2, steps=6)
    planned = plan_train(TrainRequest(run=run, plan=PlanSource(config="1-1"), workers=2,
                                      profile=str(saved)))
    graph = saved_profile(saved, get_model("mlp", **dict(_KWARGS)))
    assert [st.replicas for st in planned.cfg.plan.stages] == [1, 1]
    assert planned.predicted_samples_per_s == predict_samples_per_s(
        graph, planned.cfg.plan, run.schedule, minibatch_size=16, microbatches=2, steps=6)

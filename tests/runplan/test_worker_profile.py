"""A saved profile in place of a fresh one: ``saved_profile`` and ``train --profile``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dreampipe.api import TrainConfig
from dreampipe.commands import train_plan as train
from dreampipe.commands.train_config import TrainOptions
from dreampipe.commands.train_plan import PlanSource, TrainRequest, plan_train
from dreampipe.errors import ProfileError
from dreampipe.machine.measure import local_machine
from dreampipe.models import get_model
from dreampipe.profiling.graph import LayerGraph
from dreampipe.profiling.load import load_graph
from dreampipe.profiling.profiler import profile_spec
from dreampipe.runplan import worker_profile as local
from dreampipe.runplan.prediction import predict_samples_per_s
from dreampipe.runplan.worker_profile import saved_profile
from dreampipe.runtime.processes import pinned_threads
from dreampipe.runtime.runner_options import OptimizerKind
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout

_KWARGS = (("layers", 4), ("width", 32))
_SPEC = get_model("mlp", **dict(_KWARGS))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 4-layer mlp of width 32, profiled on one thread at 16 samples and saved."""
    path = tmp_path_factory.mktemp("profile") / "mlp.json"
    with pinned_threads(1):
        profile_spec(_SPEC, batch_size=16, repeats=2).save(path)
    return path


def _altered(saved: Path, tmp_path: Path, **meta: Any) -> Path:
    """``saved`` with ``meta`` over its own (``batch_size`` replaces the graph's)."""
    graph = load_graph(saved)
    batch = meta.pop("batch_size", graph.batch_size)
    path = tmp_path / "altered.json"
    LayerGraph(graph.layers, graph.edges, batch, graph.model, {**graph.meta, **meta}).save(path)
    return path


def test_a_saved_profile_of_the_same_model_loads_with_the_runtime_overhead(saved: Path) -> None:
    assert "runtime_forward" not in load_graph(saved).meta
    graph = saved_profile(saved, _SPEC, 16, ref="mlp", model_kwargs=_KWARGS)
    assert graph.batch_size == 16
    assert [layer.name for layer in graph.layers] == ["fc0", "fc1", "fc2", "fc3"]
    assert graph.meta["runtime_forward"] > 0 and graph.meta["loss_backward_ms"] > 0


@pytest.mark.parametrize(("kwargs", "needles"), [
    ({"layers": 4, "width": 64}, ("layer fc0 holds", "profiled at another size",
                                  "--model-arg width=64 --batch-size 16")),
    ({"layers": 6, "width": 32}, ("with 4 layers", "not mlp with 6 (fc0, fc1, fc2, ..)",
                                  "dreampipe profile mlp --model-arg layers=6")),
], ids=["other-width", "other-depth"])
def test_a_profile_of_the_model_at_another_size_is_refused_naming_the_difference(
    saved: Path, kwargs: dict[str, int], needles: tuple[str, ...]
) -> None:
    with pytest.raises(ProfileError) as err:
        saved_profile(saved, get_model("mlp", **kwargs), 16, ref="mlp",
                      model_kwargs=tuple(kwargs.items()))
    assert str(saved) in str(err.value)
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize(("meta", "needles"), [
    ({}, ("is of 16 samples", "each microbatch this run computes is 8", "--batch-size 8 -o")),
    ({"batch_size": 0}, ("does not say its batch size", "--batch-size 8 -o")),
], ids=["other-batch", "no-batch"])
def test_a_profile_at_another_batch_than_the_microbatches_is_refused(
    saved: Path, tmp_path: Path, meta: dict[str, int], needles: tuple[str, ...]
) -> None:
    with pytest.raises(ProfileError) as err:
        saved_profile(_altered(saved, tmp_path, **meta), _SPEC, 8, ref="mlp",
                      model_kwargs=_KWARGS)
    for needle in needles:
        assert needle in str(err.value)


def test_a_profile_on_more_threads_or_of_other_recorded_arguments_is_refused(
    saved: Path, tmp_path: Path
) -> None:
    with pytest.raises(ProfileError, match=r"on 2 threads.* OMP_NUM_THREADS=1 dreampipe"):
        saved_profile(_altered(saved, tmp_path, threads=2), _SPEC, 16, model_kwargs=_KWARGS)
    recorded = [["layers", 4], ["width", 32], ["bias", 0]]
    with pytest.raises(ProfileError, match=r"sized .*'bias': 0.* sizes it"):
        saved_profile(_altered(saved, tmp_path, model_kwargs=recorded), _SPEC, 16,
                      model_kwargs=_KWARGS)
    same = _altered(saved, tmp_path, model_kwargs=[list(kv) for kv in _KWARGS])
    assert saved_profile(same, _SPEC, 16, model_kwargs=_KWARGS).batch_size == 16


def test_train_with_a_saved_profile_plans_and_predicts_with_it_without_profiling(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_profiling(*_: object, **__: object) -> None:
        raise AssertionError("profiled although a profile was given")

    monkeypatch.setattr(train, "profile_as_worker", no_profiling)
    monkeypatch.setattr(local, "profile_as_worker", no_profiling)
    measured = _altered(saved, tmp_path, runtime_forward=1.1, runtime_backward=1.05,
                        loss_forward_ms=0.01, loss_backward_ms=0.02)
    run = TrainOptions(model="mlp", model_kwargs=_KWARGS, minibatch_size=32, steps=6,
                       config=TrainConfig(schedule="1f1b-flush", microbatches=2))
    planned = plan_train(TrainRequest(run=run, plan=PlanSource(config="1-1"), workers=2,
                                      profile=str(measured)))
    assert [st.replicas for st in planned.run.plan.stages] == [1, 1]
    assert len(planned.predicted_memory) == 2 and min(planned.predicted_memory) > 0
    assert planned.predicted_samples_per_s == predict_samples_per_s(
        load_graph(measured), planned.run.plan,
        MicrobatchLayout(kind=ScheduleKind.FLUSH, minibatch_size=32, microbatches=2), 6,
        local_machine(2))
    # Adam's step moves its moments too: the same plan is predicted slower
    adam = plan_train(TrainRequest(
        run=dataclasses.replace(run, optimizer=OptimizerKind.ADAM), plan=PlanSource(config="1-1"),
        workers=2, profile=str(measured)))
    assert adam.predicted_samples_per_s < planned.predicted_samples_per_s


def test_a_profile_by_shape_is_refused_as_a_runs_profile() -> None:
    spec = "gpt:layers=2,hidden=64,heads=4,seq=8,vocab=10"
    with pytest.raises(ProfileError, match=r"profile by shape.*dreampipe profile mlp"):
        saved_profile(spec, _SPEC, 16, ref="mlp", model_kwargs=_KWARGS)

"""Plans whose stages mix split, unsplit, replicated and recomputing stages train on 4
local workers as one process does, each rank within a quarter of its predicted memory.

``1t2-2r``: layers 0-1 split over workers 0-1 (rows, then columns), layers 2-3
replicated on workers 2 and 3, recomputing. Worker 0 alone sends stage 0's output (it is
replicated on both), to the replica whose microbatch it is; that replica sends its gradient
to both workers of stage 0 (:mod:`dreampipe.runtime.lanes`).

The single-process references compute each split Linear on the plan's shards
(``split_as``), so a 2048-wide layer split by its inputs sums its products in the
run's two halves: summed whole, the other order moved ``fc2.0.bias`` by 4.2e-5 under
AVX-512 kernels, past :data:`~api.compare.ATOL`, with no update wrong.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime.reference import reference_pipedream, reference_sync, sgd

from dreampipe.api import TrainConfig
from dreampipe.api.checkpoint import load_model_state
from dreampipe.api.checks import check_split
from dreampipe.errors import ConfigError
from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset
from dreampipe.planning.plan import Plan, Stage
from dreampipe.planning.splits import Split
from dreampipe.profiling.profiler import profile_spec
from dreampipe.runtime.memory import TrainingChoices, predict_memory
from dreampipe.runtime.processes import run_processes
from dreampipe.runtime.runner_options import OptimizerKind
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout

from .compare import assert_matches
from .mixed_workers import train_mixed

__all__: list[str] = []

LR, STEPS = 0.1, 4
_SPLIT = (Split.OUT, Split.IN)


def _plan(config: str, width: int) -> Plan:
    """The 4-layer mlp's ``config``: two stages of two layers, one of them split over 2."""
    stages = {
        "1t2-2r": (Stage(first=0, last=1, replicas=1, ranks=(0,), tensor_parallel=2,
                         splits=_SPLIT),
                   Stage(first=2, last=3, replicas=2, ranks=(1, 2), recompute=True)),
        "1t2r-2": (Stage(first=0, last=1, replicas=1, ranks=(0,), tensor_parallel=2,
                         splits=_SPLIT, recompute=True),
                   Stage(first=2, last=3, replicas=2, ranks=(1, 2))),
        "2-1t2": (Stage(first=0, last=1, replicas=2, ranks=(0, 1)),
                  Stage(first=2, last=3, replicas=1, ranks=(2,), tensor_parallel=2,
                        splits=(Split.OUT, Split.REPLICA))),
    }[config]
    spec = get_model("mlp", layers=4, width=width)
    plan = Plan(stages=stages, num_layers=4, model="mlp",
                layer_names=tuple(n for n, _ in spec.layer_factories))
    assert plan.config == config
    return plan


def _train(plan: Plan, width: int, schedule: ScheduleKind, minibatch: int,
           microbatches: int, **job: Any) -> list[dict[str, Any]]:
    out = run_processes(train_mixed, 4, {
        "kwargs": {"layers": 4, "width": width}, "plan": plan, "steps": STEPS, "lr": LR,
        "minibatch": minibatch, "microbatches": microbatches, "schedule": schedule.value, **job,
    }, deadline_s=150.0)
    assert all(isinstance(o, dict) for o in out)
    return out


def _sync_reference(plan: Plan, width: int, minibatch: int, microbatches: int
                    ) -> tuple[list[float], dict[str, Any]]:
    spec = get_model("mlp", layers=4, width=width)
    return reference_sync(spec, load_dataset("synthetic", spec, seed=0), steps=STEPS,
                          minibatch=minibatch, seed=0, opt=sgd(LR), microbatches=microbatches,
                          split_as=plan)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_split_a_replicated_and_a_recomputing_stage_train_as_one_process_in_predicted_memory(
) -> None:
    width, minibatch, microbatches = 2048, 64, 2
    plan = _plan("1t2-2r", width)
    out = _train(plan, width, ScheduleKind.FLUSH, minibatch, microbatches)
    assert_matches(out[0], *_sync_reference(plan, width, minibatch, microbatches))
    assert [(o["stage"], o["recomputes"]) for o in out] == [
        (0, False), (0, False), (1, True), (1, True)]

    spec = get_model("mlp", layers=4, width=width)
    layout = MicrobatchLayout(kind=ScheduleKind.FLUSH, minibatch_size=minibatch,
                              microbatches=microbatches, workers=3)
    choices = TrainingChoices(optimizer=OptimizerKind.SGD, momentum=0.0, stash=True,
                              vertical_sync=False, compensate=True)
    predicted = predict_memory(profile_spec(spec, layout.microbatch_size), plan,
                               layout.build([1, 2], STEPS, plan.in_flight), choices,
                               library=False)
    ratios = [o["used"] / predicted[o["stage"]] for o in out]
    print(f"\n{plan.config}: predicted {[round(p / 1e6, 1) for p in predicted]} MB, "
          f"measured {[round(o['used'] / 1e6, 1) for o in out]} MB")
    assert min(predicted) > 20e6, predicted  # the weights dominate the noise
    assert all(0.75 <= r <= 1.25 for r in ratios), ratios


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("config", "schedule"), [("2-1t2", ScheduleKind.FLUSH),
                                                  ("1t2r-2", ScheduleKind.GPIPE)])
def test_mixed_plans_train_and_evaluate_as_one_process(config: str,
                                                      schedule: ScheduleKind) -> None:
    plan = _plan(config, 64)
    out = _train(plan, 64, schedule, 16, 2, evaluate=2)
    assert_matches(out[0], *_sync_reference(plan, 64, 16, 2))
    assert [o["recomputes"] for o in out] == [config == "1t2r-2"] * 2 + [False] * 2
    spec = get_model("mlp", layers=4, width=64)
    model = spec.build(seed=0)
    model.load_state_dict(out[0]["state"], strict=True)
    data = load_dataset("synthetic", spec, seed=0)
    with torch.no_grad():
        want = [float(spec.loss_fn(model(x), y)) for x, y in
                (data.batch(100 + j, 16) for j in range(2))]
    assert [o["evaluated"] for o in out] == pytest.approx([sum(want) / 2] * 4, rel=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("config", "workers", "stages"), [
    ("2-2", ((0, 2), (1, 3)), [0, 1, 0, 1]),  # each server of 2 holds a copy of the pipeline
    ("2-2", ((0, 4), (1, 5)), [0, 1, 0, 1]),  # two of each server of 4: 4 processes
    ("1t2r-2", ((2,), (0, 1)), [1, 1, 0, 0]),
])
def test_a_plan_runs_its_stages_on_the_workers_it_lays_them_on(
        config: str, workers: tuple[tuple[int, ...], ...], stages: list[int]) -> None:
    """Schedule ranks start on the workers the plan's stages name (where it was priced),
    not in rank order, and train as one process does."""
    base = _plan("2-1t2", 64) if config == "2-2" else _plan(config, 64)
    if config == "2-2":
        base = dataclasses.replace(base, stages=(
            base.stages[0], Stage(first=2, last=3, replicas=2, ranks=(2, 3))))
    plan = dataclasses.replace(base, stages=tuple(
        dataclasses.replace(st, workers=w) for st, w in zip(base.stages, workers, strict=True)))
    assert plan.config == config
    out = _train(plan, 64, ScheduleKind.GPIPE, 16, 2, evaluate=1)
    assert [o["stage"] for o in out] == stages
    assert_matches(out[0], *_sync_reference(plan, 64, 16, 2))
    assert len({o["evaluated"] for o in out}) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("laid", [None, ((2,), (1, 0))])
def test_a_mixed_plan_under_pipedream_follows_the_delayed_updates_and_saves_checkpoints(
        laid: tuple[tuple[int, ...], ...] | None, tmp_path: Path) -> None:
    """Also laid out of rank order (``laid``: each stage's workers), its second stage's
    first replica on the later worker."""
    plan = _plan("1t2-2r", 64)
    if laid is not None:
        plan = dataclasses.replace(plan, stages=tuple(
            dataclasses.replace(st, workers=w) for st, w in zip(plan.stages, laid, strict=True)))
    out = _train(plan, 64, ScheduleKind.PIPEDREAM, 16, 1, save=str(tmp_path / "ck"))
    spec = get_model("mlp", layers=4, width=64)
    losses, state = reference_pipedream(
        spec, load_dataset("synthetic", spec, seed=0), bounds=[0, 2], replicas=[1, 2],
        steps=STEPS, minibatch=16, seed=0, opt=sgd(LR), compensate=True, partial_round=True,
        split_as=plan)
    assert_matches(out[0], losses, state)
    assert {o["saved"] for o in out} == {str(tmp_path / "ck" / f"step-{STEPS}")}
    saved = load_model_state(tmp_path / "ck")  # the split stage's shares, whole
    assert sorted(saved) == sorted(state)
    for name, value in out[0]["state"].items():
        assert torch.equal(saved[name], value), name


@pytest.mark.parametrize(("kind", "grad_norm", "match"), [
    (ScheduleKind.ZB_H1, None, r"zb-h1 with plan 1t2-2r: .* use 1f1b-flush"),
    (ScheduleKind.DP, None, r"schedule dp with plan 1t2-2r: .* use pipedream"),
    (ScheduleKind.TWO_BW, None, r"schedule 2bw with plan 1t2-2r: .* use pipedream"),
    (ScheduleKind.FLUSH, 1.0, r"max_grad_norm=1.0 with stages split .* drop"),
])
def test_what_a_mixed_plan_cannot_run_is_refused_with_the_fix(
        kind: ScheduleKind, grad_norm: float | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_split(_plan("1t2-2r", 8), TrainConfig(schedule=kind.value,
                                                     max_grad_norm=grad_norm))


def test_a_replicated_split_stage_is_refused_in_a_mixed_plan() -> None:
    plan = Plan(stages=(Stage(first=0, last=1, replicas=2, ranks=(0, 1), tensor_parallel=2,
                              splits=_SPLIT),
                        Stage(first=2, last=3, replicas=1, ranks=(2,))), num_layers=4)
    with pytest.raises(ConfigError, match=r"plan 2t2-1 replicates stages split over 2 workers"
                                          r".* one replica per split stage"):
        check_split(plan, TrainConfig(schedule="1f1b-flush"))

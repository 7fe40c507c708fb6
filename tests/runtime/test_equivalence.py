"""Multi-process runs against the single-process references (docs/design.md §5).

Each run trains a small model on 2-3 local gloo ranks, one Pipeline each, as
``dreampipe train`` runs them (:func:`dreampipe.commands.train_run.train_local`),
and compares every update's loss and every final parameter and buffer with
:mod:`runtime.reference` (rtol 1e-5, atol 4e-5, float32): mostly a 4-layer
mlp of width 16, plus the zoo's conv ``cnn`` (8x8 images) and an mlp with
BatchNorm (:func:`runtime.models_for_tests.bn_mlp`), whose running
statistics are buffers the weight versions do not cover. The cases
``tests/api/test_pipeline_equivalence.py`` covers (1f1b-flush on 1-1, and
PipeDream with vertical sync and on 2-1) are not repeated here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from dreampipe.commands.train_config import TrainResult
from dreampipe.commands.train_run import TrainJob, train_local
from dreampipe.models import ModelSpec, get_model
from dreampipe.models.datasets import load_dataset
from dreampipe.planning.plan import Plan
from dreampipe.runtime.runner_options import OptimizerKind
from dreampipe.scheduling.actions import ScheduleKind

from .models_for_tests import bn_mlp
from .reference import adam, reference_pipedream, reference_sync, sgd
from .runs import train_run

__all__: list[str] = []

RTOL, ATOL = 1e-5, 4e-5
SEED = 3


@dataclass(frozen=True)
class Model:
    """A model as a run names it (``TrainRun.model``) and as the test builds it."""

    name: str
    factory: Callable[..., ModelSpec]
    kwargs: tuple[tuple[str, Any], ...]

    def spec(self) -> ModelSpec:
        return self.factory(**dict(self.kwargs))


MLP = Model("mlp", lambda **kw: get_model("mlp", **kw), (("layers", 4), ("width", 16)))
CNN = Model("cnn", lambda **kw: get_model("cnn", **kw), (("image_size", 8), ("hidden", 16)))
BN_MLP = Model("runtime.models_for_tests:bn_mlp", bn_mlp, (("layers", 4), ("width", 16)))


def _spec() -> ModelSpec:
    return MLP.spec()


def _run(bounds: list[int], replicas: list[int], model: Model = MLP, **kw: object
         ) -> TrainResult:
    cfg = train_run(
        model=model.name, plan=Plan.from_config(model.spec().num_layers, bounds, replicas),
        model_kwargs=model.kwargs, seed=SEED, timeout_s=30.0, **kw,
    )
    return train_local(TrainJob(cfg), deadline_s=100.0)


def _assert_matches(result: TrainResult, losses: list[float], state: dict[str, torch.Tensor]
                    ) -> None:
    torch.testing.assert_close(
        torch.tensor(result.losses), torch.tensor(losses), rtol=RTOL, atol=ATOL
    )
    got = {k: v for s in result.stage_states for k, v in s.items()}
    assert sorted(got) == sorted(state)
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=name)


def _max_diff(result: TrainResult, state: dict[str, torch.Tensor]) -> float:
    got = {k: v for s in result.stage_states for k, v in s.items()}
    return max(float((got[k] - v).abs().max()) for k, v in state.items())


def _microbatch_counts(kind: ScheduleKind, micro: int, replicas: list[int]) -> int:
    """Microbatches per update (docs/design.md §7): ``micro`` per worker for data parallelism."""
    return micro * sum(replicas) if kind is ScheduleKind.DP else micro


SYNC_CASES = [
    (ScheduleKind.GPIPE, [0, 2], [1, 1], 4, OptimizerKind.ADAM),
    (ScheduleKind.DP, [0], [2], 2, OptimizerKind.SGD),
    (ScheduleKind.FLUSH, [0, 1, 3], [1, 1, 1], 4, OptimizerKind.ADAM),
    (ScheduleKind.GPIPE, [0, 2], [2, 1], 4, OptimizerKind.SGD),
    (ScheduleKind.NAIVE, [0, 1, 2], [1, 1, 1], 2, OptimizerKind.SGD),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("kind", "bounds", "replicas", "micro", "opt"), SYNC_CASES,
    ids=[f"{c[0].value}-{'-'.join(map(str, c[2]))}" for c in SYNC_CASES],
)
def test_sync_schedules_equal_gradient_accumulation(
    kind: ScheduleKind, bounds: list[int], replicas: list[int], micro: int, opt: OptimizerKind
) -> None:
    lr = 0.01 if opt is OptimizerKind.ADAM else 0.2
    result = _run(
        bounds, replicas, schedule=kind, minibatch_size=16, microbatches=micro, steps=3,
        optimizer=opt, lr=lr, momentum=0.0,
    )
    data = load_dataset("synthetic", _spec(), seed=SEED)
    factory = adam(lr) if opt is OptimizerKind.ADAM else sgd(lr)
    losses, state = reference_sync(
        _spec(), data, steps=3, minibatch=16, seed=SEED, opt=factory,
        microbatches=_microbatch_counts(kind, micro, replicas),
    )
    assert len(result.losses) == 3
    _assert_matches(result, losses, state)


OTHER_MODELS = [CNN, BN_MLP]
OTHER_IDS = ["cnn", "bn_mlp"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", OTHER_MODELS, ids=OTHER_IDS)
def test_flush_equals_gradient_accumulation_on_other_models(model: Model) -> None:
    # 4 microbatches of 4: BatchNorm normalises each microbatch and updates its
    # running statistics 4 times per update, in the reference as in the runtime.
    result = _run(
        [0, 2], [1, 1], model, schedule=ScheduleKind.FLUSH, minibatch_size=16, microbatches=4,
        steps=3, lr=0.2,
    )
    data = load_dataset("synthetic", model.spec(), seed=SEED)
    losses, state = reference_sync(
        model.spec(), data, steps=3, minibatch=16, seed=SEED, opt=sgd(0.2), microbatches=4
    )
    assert len(result.losses) == 3
    _assert_matches(result, losses, state)


PIPE_CASES = [
    ([0, 2], [1, 1], False, 0.0),
    ([0, 1, 3], [1, 1, 1], False, 0.9),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("bounds", "replicas", "vsync", "momentum"), PIPE_CASES,
    ids=["straight-2", "straight-3-momentum"],
)
def test_pipedream_matches_delayed_update_rule(
    bounds: list[int], replicas: list[int], vsync: bool, momentum: float
) -> None:
    steps = 6
    result = _run(
        bounds, replicas, schedule=ScheduleKind.PIPEDREAM, minibatch_size=8, steps=steps,
        lr=0.3, momentum=momentum, vertical_sync=vsync, record_events=True,
    )
    data = load_dataset("synthetic", _spec(), seed=SEED)
    losses, state = reference_pipedream(
        _spec(), data, bounds=bounds, replicas=replicas, steps=steps, minibatch=8, seed=SEED,
        opt=sgd(0.3, momentum), vertical_sync=vsync, compensate=True,
    )
    _assert_matches(result, losses, state)
    ranks = {e.rank for e in result.events}
    assert ranks == set(range(sum(replicas)))
    assert all(0 <= e.start_s <= e.end_s <= result.elapsed_s + 1e-3 for e in result.events)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", OTHER_MODELS, ids=OTHER_IDS)
def test_pipedream_matches_delayed_update_rule_on_other_models(model: Model) -> None:
    # functional_call on stashed versions of the conv / BatchNorm weights; the
    # BatchNorm running statistics are live buffers updated by every forward.
    bounds, replicas, steps = [0, 2], [1, 1], 6
    result = _run(
        bounds, replicas, model, schedule=ScheduleKind.PIPEDREAM, minibatch_size=8, steps=steps,
        lr=0.3,
    )
    data = load_dataset("synthetic", model.spec(), seed=SEED)
    losses, state = reference_pipedream(
        model.spec(), data, bounds=bounds, replicas=replicas, steps=steps, minibatch=8,
        seed=SEED, opt=sgd(0.3), compensate=True,
    )
    _assert_matches(result, losses, state)


@pytest.mark.timeout(120)
def test_without_stashing_the_delayed_update_rule_breaks() -> None:
    bounds, replicas = [0, 1, 3], [1, 1, 1]
    result = _run(
        bounds, replicas, schedule=ScheduleKind.PIPEDREAM, minibatch_size=8, steps=6, lr=0.3,
        stash=False,
    )
    data = load_dataset("synthetic", _spec(), seed=SEED)
    _, state = reference_pipedream(
        _spec(), data, bounds=bounds, replicas=replicas, steps=6, minibatch=8, seed=SEED,
        opt=sgd(0.3),
    )
    assert _max_diff(result, state) > 10 * ATOL

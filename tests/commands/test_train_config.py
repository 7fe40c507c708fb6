"""What ``dreampipe train`` checks before any rank starts
(:mod:`dreampipe.commands.train_config`)."""

from __future__ import annotations

import dataclasses

import pytest

from dreampipe.api import TrainConfig
from dreampipe.commands.train_config import TrainOptions, check_options, check_run
from dreampipe.errors import ConfigError, DatasetError, PlanError
from dreampipe.models import get_model
from dreampipe.planning.plan import Plan
from dreampipe.runtime.runner_options import OptimizerKind

__all__: list[str] = []

_SPEC = get_model("mlp", layers=4, width=16)
_OPTS = TrainOptions(model="mlp", model_kwargs=(("layers", 4), ("width", 16)), steps=4,
                     minibatch_size=8)


def _plan(bounds: list[int], replicas: list[int], **kw: object) -> Plan:
    return Plan.from_config(4, bounds, replicas, model="mlp", **kw)  # type: ignore[arg-type]


def test_valid_options_and_runs_pass() -> None:
    check_options(_OPTS)
    check_run(_OPTS.with_plan(_plan([0, 2], [1, 1]), 4), _SPEC, 2)
    run = dataclasses.replace(_OPTS, config=TrainConfig(schedule="1f1b-flush", microbatches=2))
    check_run(run.with_plan(_plan([0, 2], [2, 1]), 4), _SPEC)


@pytest.mark.parametrize(("change", "error", "needle"), [
    ({"steps": 0}, ConfigError, "steps=0; use 1 or more"),
    ({"lr": 0.0}, ConfigError, "lr=0.0: the learning rate must be positive"),
    ({"dataset": "nope"}, DatasetError, "unknown dataset 'nope'; use one of"),
    ({"config": TrainConfig(resume="latest")}, ConfigError, "resume=True, not"),
])
def test_each_option_rule_names_the_value_and_the_fix(
    change: dict[str, object], error: type[Exception], needle: str
) -> None:
    opts = dataclasses.replace(_OPTS, **change)  # type: ignore[arg-type]
    with pytest.raises(error, match=needle):
        check_options(opts)
    with pytest.raises(error, match=needle):  # a run checks its options too
        check_run(opts.with_plan(_plan([0, 2], [1, 1]), opts.steps), _SPEC)


def test_a_plan_that_does_not_fit_the_model_or_the_world_is_refused() -> None:
    with pytest.raises(PlanError, match="uses 2 workers but 3 were started"):
        check_run(_OPTS.with_plan(_plan([0, 2], [1, 1]), 4), _SPEC, 3)
    with pytest.raises(PlanError, match="a model of 6 layers but mlp has 4"):
        check_run(_OPTS.with_plan(Plan.from_config(6, [0, 3], [1, 1]), 4), _SPEC)
    other = dataclasses.replace(_plan([0, 2], [1, 1]),
                                layer_names=("fc0", "fc1", "oops", "fc3"))
    with pytest.raises(PlanError, match="its layer 2 is 'oops' but mlp's is 'fc2'"):
        check_run(_OPTS.with_plan(other, 4), _SPEC)


def test_a_layout_that_cannot_split_the_minibatch_is_refused_before_the_run() -> None:
    opts = dataclasses.replace(_OPTS, config=TrainConfig(schedule="gpipe", microbatches=3))
    with pytest.raises(ConfigError, match="minibatch_size=8 is not divisible by microbatches=3"):
        check_run(opts.with_plan(_plan([0, 2], [1, 1]), opts.steps), _SPEC)


def test_a_plan_of_virtual_stages_needs_the_interleaved_schedule() -> None:
    plan = _plan([0, 1, 2, 3], [1, 1, 1, 1], virtual_stages=2)
    with pytest.raises(ConfigError, match="interleaved"):
        check_run(_OPTS.with_plan(plan, 4), _SPEC)
    opts = dataclasses.replace(_OPTS, config=TrainConfig(schedule="interleaved-1f1b",
                                                         microbatches=2))
    check_run(opts.with_plan(plan, 4), _SPEC, 2)


def test_the_optimizer_factory_and_memory_choices_follow_the_options() -> None:
    import torch

    adam = dataclasses.replace(_OPTS, optimizer=OptimizerKind.ADAM, lr=0.5)
    params = [torch.nn.Parameter(torch.zeros(2))]
    built = adam.optimizer_factory()(params)
    assert isinstance(built, torch.optim.Adam) and built.defaults["lr"] == 0.5
    sgd = dataclasses.replace(_OPTS, momentum=0.9).optimizer_factory()(params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    choices = adam.memory_choices()
    assert choices.optimizer is OptimizerKind.ADAM and choices.stash == adam.config.stash


def test_with_plan_keeps_every_option_and_counts_the_plans_workers() -> None:
    opts = dataclasses.replace(_OPTS, lr=0.3, dataset="digits", evaluate=False)
    run = opts.with_plan(_plan([0, 2], [2, 1]), 7)
    for field in dataclasses.fields(opts):
        if field.name != "steps":
            assert getattr(run, field.name) == getattr(opts, field.name), field.name
    assert run.steps == 7 and run.workers == 3
    assert run.layout.microbatch_size == 8

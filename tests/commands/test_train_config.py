"""``commands.train_config``: each check names the field and the fix, valid runs pass, and the
records keep every field from options to run and across a process boundary."""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.api.config import TrainConfig
from dreampipe.commands.train_config import (
    TrainOptions,
    TrainResult,
    TrainRun,
    check_options,
    check_run,
)
from dreampipe.errors import ConfigError, DatasetError, PlanError, ScheduleError
from dreampipe.models import get_model
from dreampipe.models.datasets import DATASETS
from dreampipe.planning.plan import Plan
from dreampipe.runtime.runner_options import OptimizerKind
from dreampipe.scheduling.actions import ActionKind, ScheduleKind
from dreampipe.scheduling.events import Event

__all__: list[str] = []

_KWARGS = (("layers", 4), ("width", 32))
SPEC = get_model("mlp", **dict(_KWARGS))


def _plan(bounds: list[int], replicas: list[int], **kw: Any) -> Plan:
    return Plan.from_config(SPEC.num_layers, bounds, replicas, model=SPEC.name, **kw)


def _run(plan: Plan, **kw: Any) -> TrainRun:
    return TrainRun(model="mlp", model_kwargs=_KWARGS, plan=plan, **kw)


def _options(**kw: Any) -> TrainOptions:
    return TrainOptions(model="mlp", **kw)


# ---- check_options ----------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(steps=st.integers(max_value=0))
def test_check_options_refuses_fewer_than_one_step(steps: int) -> None:
    with pytest.raises(ConfigError) as info:
        check_options(_options(steps=steps))
    assert info.value.parameters == ("steps",)
    assert f"steps={steps}" in str(info.value) and "use 1 or more" in str(info.value)


@settings(max_examples=25, deadline=None)
@given(lr=st.floats(max_value=0.0, allow_nan=False))
def test_check_options_refuses_a_learning_rate_that_is_not_positive(lr: float) -> None:
    with pytest.raises(ConfigError) as info:
        check_options(_options(lr=lr))
    assert info.value.parameters == ("lr",)
    assert f"lr={lr}" in str(info.value) and "must be positive" in str(info.value)


def test_check_options_names_the_datasets_it_knows() -> None:
    with pytest.raises(DatasetError) as info:
        check_options(_options(dataset="cifar"))
    assert "'cifar'" in str(info.value)
    assert all(name in str(info.value) for name in DATASETS)


def test_check_options_sends_a_config_resume_to_checkpoint_dir() -> None:
    with pytest.raises(ConfigError) as info:
        check_options(_options(config=TrainConfig(resume="ck")))
    assert set(info.value.parameters) == {"checkpoint_dir", "resume"}
    assert "resume='ck'" in str(info.value) and "drop that" in str(info.value)


@settings(max_examples=40, deadline=None)
@given(steps=st.integers(1, 10**6), lr=st.floats(1e-9, 10.0),
       dataset=st.sampled_from(DATASETS), momentum=st.floats(0.0, 0.99))
def test_check_options_passes_every_valid_option(steps: int, lr: float, dataset: str,
                                                 momentum: float) -> None:
    check_options(_options(steps=steps, lr=lr, dataset=dataset, momentum=momentum))


# ---- check_run: each rule -----------------------------------------------------------------

def _refused(run: TrainRun, error: type[Exception], *needles: str,
             world: int | None = None) -> Exception:
    with pytest.raises(error) as info:
        check_run(run, SPEC, world)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    return info.value


def test_check_run_refuses_stages_per_worker_other_than_the_plans() -> None:
    run = _run(_plan([0, 2], [1, 1]),
               config=TrainConfig(schedule="interleaved-1f1b", virtual_stages=2,
                                  microbatches=2))
    err = _refused(run, ConfigError, "virtual_stages=2", "one stage per worker",
                   "drop virtual_stages=2")
    assert isinstance(err, ConfigError) and err.parameters == ("virtual_stages",)


def test_check_run_refuses_a_plan_of_several_stages_per_worker_but_under_interleaving() -> None:
    run = _run(_plan([0, 1, 2, 3], [1, 1, 1, 1], virtual_stages=2))
    err = _refused(run, ConfigError, "schedule=pipedream", "2 stages per worker",
                   "use schedule=interleaved-1f1b")
    assert isinstance(err, ConfigError) and err.parameters == ("schedule",)


def test_check_run_refuses_a_world_other_than_the_plans_workers() -> None:
    run = _run(_plan([0, 2], [2, 1]))
    _refused(run, PlanError, "uses 3 workers but 2 were started",
             "start 3 workers or plan for 2", world=2)
    check_run(run, SPEC, 3)


def test_check_run_refuses_more_stages_than_layers() -> None:
    plan = Plan.from_config(5, [0, 1, 2, 3, 4], [1] * 5)
    _refused(_run(plan), PlanError, "5 stages", "only 4 layers", "use at most 4 stages")


def test_check_run_refuses_a_plan_for_another_number_of_layers() -> None:
    plan = Plan.from_config(6, [0, 3], [1, 1])
    _refused(_run(plan), PlanError, "6 layers", "mlp has 4", "plan again for this model")


def test_check_run_names_the_first_layer_that_differs() -> None:
    names = list(SPEC.layer_names)
    names[2] = "conv"
    run = _run(_plan([0, 2], [1, 1], layer_names=tuple(names)))
    _refused(run, PlanError, "its layer 2 is 'conv'", f"mlp's is {SPEC.layer_names[2]!r}",
             "plan again")
    check_run(_run(_plan([0, 2], [1, 1], layer_names=tuple(SPEC.layer_names))), SPEC)


def test_check_run_checks_the_options_too() -> None:
    err = _refused(_run(_plan([0, 2], [1, 1]), steps=0), ConfigError, "steps=0")
    assert isinstance(err, ConfigError) and err.parameters == ("steps",)


def test_check_run_refuses_a_minibatch_its_microbatches_do_not_divide() -> None:
    run = _run(_plan([0, 2], [1, 1]), minibatch_size=30,
               config=TrainConfig(schedule="1f1b-flush", microbatches=4))
    err = _refused(run, ConfigError, "minibatch_size=30", "microbatches=4")
    assert isinstance(err, ConfigError)
    assert set(err.parameters) == {"minibatch_size", "microbatches"}


def test_check_run_refuses_dp_on_a_plan_of_several_stages() -> None:
    run = _run(_plan([0, 2], [1, 1]), config=TrainConfig(schedule="dp"))
    _refused(run, ScheduleError, "one stage on every worker", "use a one-stage plan")


def test_check_run_refuses_a_shared_pipedream_version_over_unequal_replicas() -> None:
    run = _run(_plan([0, 2], [2, 1]), config=TrainConfig(max_grad_norm=1.0))
    err = _refused(run, ConfigError, "max_grad_norm=1.0", "2-1",
                   "use a plan with equal replica counts")
    assert isinstance(err, ConfigError) and err.parameters == ("plan",)
    check_run(_run(_plan([0, 2], [2, 2]), config=TrainConfig(max_grad_norm=1.0)), SPEC)


def test_check_run_refuses_2bw_microbatches_two_versions_cannot_hold_and_names_enough() -> None:
    plan = _plan([0, 1, 2, 3], [1, 1, 1, 1])
    _refused(_run(plan, config=TrainConfig(schedule="2bw", microbatches=2)), ScheduleError,
             "2bw with 2 microbatches", "use at least 3 microbatches")
    check_run(_run(plan, minibatch_size=33, config=TrainConfig(schedule="2bw",
                                                                microbatches=3)), SPEC)


@pytest.mark.parametrize(("plan", "config", "minibatch"), [
    (_plan([0, 2], [1, 1]), TrainConfig(), 32),
    (_plan([0, 2], [2, 1]), TrainConfig(schedule="1f1b-flush", microbatches=4), 32),
    (_plan([0], [2]), TrainConfig(schedule="dp", microbatches=2), 32),
    (_plan([0, 1, 2, 3], [1, 1, 1, 1], virtual_stages=2),
     TrainConfig(schedule="interleaved-1f1b", microbatches=4), 32),
    (_plan([0, 2], [1, 1]), TrainConfig(schedule="2bw", microbatches=2), 16),
    (_plan([0, 2], [1, 1]), TrainConfig(schedule="zb-h1", microbatches=4), 16),
], ids=["pipedream", "flush-2-1", "dp", "interleaved", "2bw", "zb-h1"])
def test_check_run_passes_valid_runs(plan: Plan, config: TrainConfig, minibatch: int) -> None:
    run = _run(plan, config=config, minibatch_size=minibatch)
    check_run(run, SPEC)
    check_run(run, SPEC, plan.workers_used)


# ---- the records ------------------------------------------------------------------------

def test_a_run_uses_the_plans_workers_and_cuts_updates_as_its_config_says() -> None:
    assert _run(_plan([0, 2], [2, 1])).workers == 3
    assert _run(_plan([0, 1, 2, 3], [1, 1, 1, 1], virtual_stages=2)).workers == 2
    run = _run(_plan([0], [4]), minibatch_size=32, config=TrainConfig(schedule="dp"))
    layout = run.layout
    assert (layout.kind, layout.minibatch_size, layout.microbatches, layout.workers) == (
        ScheduleKind.DP, 32, 1, 4)


def test_a_run_that_cannot_be_cut_is_made_but_its_layout_raises() -> None:
    run = _run(_plan([0], [4]), minibatch_size=30, config=TrainConfig(schedule="dp"))
    with pytest.raises(ConfigError, match="minibatch_size=30 is not divisible"):
        _ = run.layout


def test_with_plan_keeps_every_option_and_replaces_the_steps() -> None:
    opts = TrainOptions(
        model="mlp", config=TrainConfig(schedule="gpipe", microbatches=2, seed=5,
                                        measure_memory=True),
        minibatch_size=8, steps=7, optimizer=OptimizerKind.ADAM, lr=0.5, momentum=0.3,
        dataset="digits", data_dir="/data", model_kwargs=_KWARGS, evaluate=False,
        progress=True, seq_lengths=(4, 8),
    )
    defaults = TrainOptions(model="other")
    changed = [f.name for f in dataclasses.fields(TrainOptions)
               if getattr(opts, f.name) == getattr(defaults, f.name)]
    assert changed == [], "every field differs from its default, so a dropped one shows"
    plan = _plan([0, 2], [1, 1])
    run = opts.with_plan(plan, 12)
    assert isinstance(run, TrainRun)
    assert run.plan is plan and run.steps == 12
    for f in dataclasses.fields(TrainOptions):
        if f.name != "steps":
            assert getattr(run, f.name) == getattr(opts, f.name), f.name


def test_a_run_crosses_a_process_boundary_unchanged() -> None:
    run = _run(_plan([0, 2], [2, 1], layer_names=tuple(SPEC.layer_names)),
               config=TrainConfig(schedule="1f1b-flush", microbatches=4), minibatch_size=32)
    _ = run.layout  # cached before pickling, as train_local's check leaves it
    back = pickle.loads(pickle.dumps(run))
    assert back == run
    assert back.plan.to_dict() == run.plan.to_dict()
    assert back.layout == run.layout


def test_a_result_crosses_a_process_boundary_unchanged() -> None:
    result = TrainResult(
        samples_per_s=12.5, final_loss=0.25, losses=(1.0, 0.5, 0.25), accuracy=0.9,
        events=(Event(0, 0, ActionKind.FORWARD, 0, 0.0, 0.1),), elapsed_s=3.0,
        stage_states=({"w": torch.arange(4.0)},),
    )
    back = pickle.loads(pickle.dumps(result))
    assert (back.samples_per_s, back.final_loss, back.losses, back.accuracy, back.events,
            back.elapsed_s, back.memory) == (12.5, 0.25, (1.0, 0.5, 0.25), 0.9, result.events,
                                             3.0, ())
    assert torch.equal(back.stage_states[0]["w"], torch.arange(4.0))


def test_the_optimizer_factory_builds_the_asked_optimizer_for_each_stage() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    sgd = _options(lr=0.2, momentum=0.7).optimizer_factory()(params)
    assert type(sgd) is torch.optim.SGD
    assert (sgd.param_groups[0]["lr"], sgd.param_groups[0]["momentum"]) == (0.2, 0.7)
    adam = _options(optimizer=OptimizerKind.ADAM, lr=0.03).optimizer_factory()(params)
    assert type(adam) is torch.optim.Adam and adam.param_groups[0]["lr"] == 0.03
    build = _options().optimizer_factory()
    other = [torch.nn.Parameter(torch.ones(2))]
    assert build(other).param_groups[0]["params"] == other, "each stage its own parameters"


def test_memory_choices_change_with_what_memory_depends_on_only() -> None:
    base = _options(config=TrainConfig(compensate=False))
    same = [_options(config=TrainConfig(compensate=False, seed=3, timeout_s=5.0), lr=0.5,
                     steps=3, dataset="digits", minibatch_size=4)]
    differ = [
        _options(config=TrainConfig(compensate=False), optimizer=OptimizerKind.ADAM),
        _options(config=TrainConfig(compensate=False), momentum=0.9),
        _options(config=TrainConfig(compensate=False, stash=False)),
        _options(config=TrainConfig(compensate=False, vertical_sync=True)),
        _options(config=TrainConfig(compensate=True)),
    ]
    assert all(o.memory_choices() == base.memory_choices() for o in same)
    assert all(o.memory_choices() != base.memory_choices() for o in differ)
    assert len({o.memory_choices() for o in differ}) == len(differ)


@pytest.mark.parametrize("lr", [math.nan, math.inf])
def test_check_options_refuses_a_learning_rate_that_is_not_a_positive_number(lr: float) -> None:
    with pytest.raises(ConfigError) as info:
        check_options(TrainOptions(model="mlp", lr=lr))
    assert info.value.parameters == ("lr",)


@pytest.mark.parametrize(("config", "optimizer"), [
    (TrainConfig(schedule="1f1b-flush"), OptimizerKind.ADAM),
    (TrainConfig(schedule="pipedream", compensate=False), OptimizerKind.ADAM),
    (TrainConfig(schedule="pipedream", stash=False), OptimizerKind.ADAM),
    (TrainConfig(schedule="2bw"), OptimizerKind.SGD),
])
def test_a_run_in_which_no_stage_predicts_its_weights_prices_no_prediction(
        config: TrainConfig, optimizer: OptimizerKind) -> None:
    """Only Adam's compensation on an asynchronous schedule with stashing predicts."""
    assert _options(config=config, optimizer=optimizer, momentum=0.9).prediction_factor() == 0


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_adam_compensated_on_an_asynchronous_schedule_prices_its_prediction(schedule: str
                                                                            ) -> None:
    options = _options(config=TrainConfig(schedule=schedule), optimizer=OptimizerKind.ADAM)
    assert options.prediction_factor() > 1


def test_a_split_stage_s_layers_are_checked_before_any_rank_starts() -> None:
    """A weight split of a layer that is not one Linear (the planner prices a Conv's
    ``out``) is refused in the parent, naming the layer, not by every rank after start."""
    from dreampipe.planning.plan import Stage
    from dreampipe.planning.splits import Split

    cnn = get_model("cnn")
    plan = Plan(stages=(Stage(first=0, last=cnn.num_layers - 1, replicas=1, ranks=(0,),
                              tensor_parallel=2,
                              splits=(Split.OUT,) + (Split.BATCH,) * (cnn.num_layers - 1)),),
                num_layers=cnn.num_layers, layer_names=tuple(cnn.layer_names))
    run = TrainRun(model="cnn", plan=plan, config=TrainConfig(schedule="1f1b-flush"))
    with pytest.raises(PlanError, match=rf"layer '{cnn.layer_names[0]}' \(.*\) of split stage "
                                        r"0 has 0 Linear modules"):
        check_run(run, cnn)

"""Bad input: each a clear error, raised before the pipeline sends anything."""

from __future__ import annotations

import inspect
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dreampipe
from dreampipe.api.ties import check_ties
from dreampipe.errors import CheckpointError, ConfigError, DatasetError, PlanError, WorkerError
from dreampipe.planning.plan_stage import Stage
from dreampipe.planning.splits import Split
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.splitter.chain import Tie, split_layers, tied_parameters

__all__: list[str] = []


EXAMPLE = (torch.randn(4, 6), torch.randint(0, 3, (4,)))


def _model(width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, 3))


_ARGS = ("example", "loss_fn", "optimizer", "plan", "lr_scheduler")


def _pipe(model: nn.Module | None = None, **kw: Any) -> dreampipe.Pipeline:
    """A Pipeline of ``kw``'s arguments, the others its config's fields."""
    args: dict[str, Any] = {"example": EXAMPLE, "loss_fn": F.cross_entropy,
                            "optimizer": lambda p: torch.optim.SGD(p, lr=0.1),
                            **{k: v for k, v in kw.items() if k in _ARGS}}
    config = {"schedule": "1f1b-flush", **{k: v for k, v in kw.items() if k not in _ARGS}}
    return dreampipe.Pipeline(_model() if model is None else model, **args,
                              config=dreampipe.TrainConfig(**config))


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x) + x)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) if x.sum() > 0 else -self.a(x)


def test_a_residual_model_is_cut_between_its_modules() -> None:
    pipe = _pipe(_Residual())
    assert pipe.plan.layer_names == ("a", "b")
    pipe.close()


def test_a_model_fx_cannot_trace_names_the_module_and_the_reason() -> None:
    with pytest.raises(PlanError, match=r"cannot split _Branchy: torch.fx cannot trace its "
                                        r"forward \(TraceError: .*control flow"):
        _pipe(_Branchy())


def test_a_split_point_inside_a_block_names_the_block_and_the_points_around_it() -> None:
    with pytest.raises(ConfigError, match=r"split point 'a.weight' is inside 'a', a Linear that "
                                          r"runs whole on one stage; split at 'a' or 'b'"):
        _pipe(_Residual(), plan=["a.weight"])


def test_an_unknown_split_point_suggests_the_nearest() -> None:
    with pytest.raises(ConfigError, match=r"split point 'bb' names no module of the model; "
                                          r"the nearest valid split points are 'b'"):
        _pipe(_Residual(), plan=["bb"])


def test_a_split_point_as_one_string_asks_for_a_list() -> None:
    with pytest.raises(PlanError, match=r"plan='b' is neither 'auto', a Plan, a plan file nor "
                                        r"a list of split points; to cut before module 'b', "
                                        r"give plan=\['b'\]"):
        _pipe(_Residual(), plan="b")


def test_split_points_make_one_stage_each_so_the_world_must_fit() -> None:
    with pytest.raises(PlanError, match=r"uses 2 workers but 1 were started"):
        _pipe(_Residual(), plan=("b",))


def test_keywords_of_the_config_name_the_config_field() -> None:
    model = _model()
    args: dict[str, Any] = {"example": EXAMPLE, "loss_fn": F.cross_entropy,
                            "optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}
    with pytest.raises(ConfigError, match=re.escape(
            "schedule= is a TrainConfig field now: Pipeline(..., "
            "config=TrainConfig(schedule='1f1b-flush'))")) as info:
        dreampipe.Pipeline(model, **args, schedule="1f1b-flush")
    assert info.value.parameters == ("schedule",)
    with pytest.raises(ConfigError, match=re.escape(
            "schedule=, microbatches= are TrainConfig fields now: Pipeline(..., "
            "config=TrainConfig(schedule='gpipe', microbatches=2))")):
        dreampipe.Pipeline(model, **args, schedule=dreampipe.ScheduleKind.GPIPE, microbatches=2)
    with pytest.raises(ConfigError, match=re.escape(
            "split_points= is plan= now: Pipeline(..., plan=['2'])")):
        dreampipe.Pipeline(model, **args, split_points=["2"])
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'lr_schedule'; did you "
                                        r"mean lr_scheduler=\?"):
        dreampipe.Pipeline(model, **args, lr_schedule=None)
    with pytest.raises(ConfigError, match=r"config=\{'schedule': 'gpipe'\}; give a TrainConfig"):
        dreampipe.Pipeline(model, **args, config={"schedule": "gpipe"})  # type: ignore[arg-type]


def test_the_pipeline_takes_at_most_eight_parameters() -> None:
    params = inspect.signature(dreampipe.Pipeline).parameters
    assert len(params) <= 8, list(params)
    assert list(params)[:7] == ["model", "example", "loss_fn", "optimizer", "plan", "config",
                                "lr_scheduler"]
    assert params["config"].default == dreampipe.TrainConfig()


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 5, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.mid(self.embed(x)))


def test_a_weight_tied_across_stages_is_found_under_each_stages_name() -> None:
    layers = split_layers(_Tied())
    assert tied_parameters(layers, [0]) == []
    assert tied_parameters(layers, [0, 2]) == [Tie((0, 1), ("embed.weight", "head.weight"))]


def test_a_tie_on_a_split_stage_is_an_error_before_training() -> None:
    layers = split_layers(_Tied())
    check_ties(tied_parameters(layers, [0, 2]), dreampipe.Plan.from_config(3, [0, 2], [2, 1])
               )  # a replicated stage keeps its tie (tests/api/test_pipeline_precision.py)
    copies = dreampipe.Plan.from_config(4, [0, 1, 2, 3], [2, 2, 2, 2], virtual_stages=2)
    check_ties([Tie((0, 3), ("embed.weight", "head.weight"))], copies)  # and so do copies
    plan = dreampipe.Plan(stages=(
        Stage(first=0, last=1, replicas=1, ranks=(0,), tensor_parallel=2,
              splits=(Split.REPLICA, Split.REPLICA)),
        Stage(first=2, last=2, replicas=1, ranks=(1,))), num_layers=3)
    with pytest.raises(ConfigError, match=r"parameter 'embed.weight' is tied to 'head.weight' on "
                                          r"stages 0, 1, which plan .* splits over workers"):
        check_ties(tied_parameters(layers, [0, 2]), plan)


@pytest.mark.parametrize("replicas", [[2, 1], [1, 2]])
def test_a_tie_on_stages_pipedream_updates_at_different_rates_is_refused(
        replicas: list[int]) -> None:
    """Under pipedream a stage's updates count its own minibatches: stages replicated
    unequally never reach one update to sum a tied weight's gradients in (it hung)."""
    ties = tied_parameters(split_layers(_Tied()), [0, 2])
    plan = dreampipe.Plan.from_config(3, [0, 2], replicas)
    check_ties(ties, plan, ScheduleKind.TWO_BW)  # 2bw's updates are every stage's
    check_ties(ties, dreampipe.Plan.from_config(3, [0, 2], [2, 2]), ScheduleKind.PIPEDREAM)
    with pytest.raises(ConfigError, match=r"parameter 'embed.weight' tied to 'head.weight' on "
                                          r"stages 0, 1 with pipedream needs every stage "
                                          r"replicated equally \(got " + "-".join(
                                              map(str, replicas))):
        check_ties(ties, plan, ScheduleKind.PIPEDREAM)


def test_a_batch_shaped_unlike_the_example_names_both_shapes() -> None:
    pipe = _pipe()
    pipe.step(*EXAMPLE)
    with pytest.raises(DatasetError, match=r"minibatch 1's input is torch.float32 \[3, 6\] but "
                                           r"example's is torch.float32 \[4, 6\].*drop_last"):
        pipe.step(EXAMPLE[0][:3], EXAMPLE[1][:3])


def test_a_loss_that_is_not_a_scalar() -> None:
    with pytest.raises(ConfigError,
                       match=r"loss_fn returned a tensor of shape \[4\], not a scalar"):
        _pipe(loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"))


@pytest.mark.parametrize("loss_fn", [lambda out: out.sum(), lambda out, y, z: out.sum()])
def test_a_loss_fn_that_cannot_take_output_and_target_says_so(loss_fn: Any) -> None:
    # found before the run, on every rank, even where the dry run on meta cannot run
    with pytest.raises(ConfigError, match=r"cannot be called as loss_fn\(output, target\)"):
        _pipe(loss_fn=loss_fn)


def test_an_optimizer_factory_that_returns_something_else() -> None:
    with pytest.raises(ConfigError,
                       match=r"optimizer returned a list, not a torch.optim.Optimizer"):
        _pipe(optimizer=lambda params: list(params))


def test_a_factory_that_knows_its_parameters_by_identity_is_checked_on_them() -> None:
    """The early check's stand-in parameter is none of the model's: a factory that looks
    its parameters' names up is not failed by it, and still checked on the stage's."""
    model = _model()
    names = {id(p): n for n, p in model.named_parameters()}

    def grouped(params: list[nn.Parameter]) -> Any:
        decay = [p for p in params if not names[id(p)].endswith("bias")]
        rest = [p for p in params if names[id(p)].endswith("bias")]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}])

    pipe = dreampipe.Pipeline(model, example=EXAMPLE, loss_fn=F.cross_entropy,
                              optimizer=grouped, plan=dreampipe.Plan.from_config(3, [0], [1]))
    assert [len(g["params"]) for g in pipe.module.optimizer.param_groups] == [2, 2]
    pipe.close()
    other = _model()
    names.update({id(p): n for n, p in other.named_parameters()})
    with pytest.raises(ConfigError, match=r"optimizer returned a list"):
        dreampipe.Pipeline(other, example=EXAMPLE, loss_fn=F.cross_entropy,
                           optimizer=lambda ps: [names[id(p)] for p in ps],
                           plan=dreampipe.Plan.from_config(3, [0], [1]))


def test_a_scheduler_that_needs_a_metric_is_refused_with_the_way_to_step_it() -> None:
    with pytest.raises(ConfigError, match=r"ReduceLROnPlateau.*pipe.module.optimizer"):
        _pipe(lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau)


def test_unknown_schedule_lists_the_names() -> None:
    with pytest.raises(ConfigError, match=r"schedule='1f1b'; use one of pipedream, 1f1b-flush"):
        _pipe(schedule="1f1b")
    with pytest.raises(ConfigError, match="on_nonfinite=skip needs every stage to update"):
        _pipe(schedule="pipedream", on_nonfinite="skip")


def test_resume_with_a_plan_that_does_not_cover_the_model() -> None:
    plan = dreampipe.Plan.from_config(2, [0], [1])
    with pytest.raises(PlanError, match=r"the plan covers 2 layers but the model has 3"):
        _pipe(plan=plan, resume="/nonexistent")


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    pipe = _pipe()
    pipe.step(*EXAMPLE)
    first = pipe.save(tmp_path)
    pipe.step(*EXAMPLE)
    pipe.save(tmp_path)
    pipe.close()
    return first


def test_a_checkpoint_of_another_model_names_missing_and_unexpected_keys(saved: Path) -> None:
    other = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(CheckpointError, match=r"another model: missing keys \['3.weight', "
                                              r"'3.bias'\], unexpected keys \['2.weight', "
                                              r"'2.bias'\]"):
        _pipe(other, resume=saved.parent)
    with pytest.raises(CheckpointError, match=r"holds 0.weight of shape \[8, 6\], the model's "
                                              r"is \[5, 6\]"):
        _pipe(_model(width=5), resume=saved.parent)


def test_a_truncated_checkpoint_file_is_never_loaded(saved: Path) -> None:
    newest = saved.parent / "step-2"
    data = next(newest.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{newest} is damaged: {data.name} is 100 bytes"
                                              rf".*resume from {saved}"):
        _pipe(resume=saved.parent)


def test_an_uncommitted_checkpoint_is_never_loaded_and_the_error_names_the_last_complete(
    saved: Path,
) -> None:
    newest = saved.parent / "step-2"
    (newest / "COMMITTED").unlink()
    shutil.copytree(newest, saved.parent / "step-3.tmp")
    with pytest.raises(CheckpointError, match=rf"{newest} was never committed.*the last "
                                              rf"complete one is {saved}"):
        _pipe(resume=newest)
    with pytest.raises(CheckpointError, match=r"was never committed"):
        _pipe(resume=saved.parent / "step-3.tmp")
    pipe = _pipe(resume=saved.parent)  # the directory: its newest committed checkpoint
    assert pipe.minibatches == 1


@pytest.mark.parametrize(("kw", "needle"), [
    ({"virtual_stages": 2}, r"virtual_stages=2 with schedule=1f1b-flush; use 1, or "
                            r"schedule=interleaved-1f1b"),
    ({"virtual_stages": 2, "schedule": "interleaved-1f1b"},
     r"virtual_stages=2 with plan='auto'; give split points \(plan=\[...\]\) or a plan of "
     r"world x 2 stages"),
    ({"virtual_stages": 2, "schedule": "interleaved-1f1b", "plan": ["1", "2"]},
     r"virtual_stages=2 on 1 workers needs 2 stages, not the plan's 3"),
])
def test_virtual_stages_that_cannot_run_name_the_fix(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _pipe(**kw)


@pytest.mark.parametrize(("kw", "needle"), [
    ({"schedule": "interleaved-1f1b", "virtual_stages": 1},
     r"virtual_stages=1 but plan '.*p.json' runs 2 stages per worker \(its virtual_stages is "
     r"2\); drop virtual_stages=1"),
    ({}, r"schedule=1f1b-flush for plan '.*p.json', which runs 2 stages per worker"),
    ({"schedule": "auto"}, r"schedule=auto for plan '.*p.json', which runs 2 stages per "
                           r"worker.*use schedule=interleaved-1f1b"),
])
def test_a_plan_file_of_two_stages_per_worker_refuses_what_contradicts_it(
    kw: dict[str, Any], needle: str, tmp_path: Path,
) -> None:
    path = tmp_path / "p.json"
    dreampipe.Plan.from_config(3, [0, 2], [1, 1], virtual_stages=2).save(path)
    with pytest.raises(ConfigError, match=needle):
        _pipe(plan=str(path), **kw)


def test_virtual_stages_against_a_plan_of_one_stage_per_worker_names_both() -> None:
    plan = dreampipe.Plan.from_config(3, [0, 2], [1, 1])
    with pytest.raises(ConfigError, match=r"virtual_stages=2 but the plan runs one stage per "
                                          r"worker \(its virtual_stages is 1\).*"
                                          r"Plan.from_config\(..., virtual_stages=2\)"):
        _pipe(plan=plan, schedule="interleaved-1f1b", virtual_stages=2)


@pytest.mark.parametrize("plan", [None, 3])
def test_a_plan_of_another_kind_names_the_kinds_it_takes(plan: Any) -> None:
    with pytest.raises(ConfigError, match=r"plan=(None|3): give 'auto' .* a Plan, a plan "
                                          r"file's path, or a list of split points"):
        _pipe(plan=plan)


def test_a_loss_that_is_not_a_scalar_on_a_model_meta_cannot_run_is_named_at_its_step() -> None:
    """GPT-2 cannot run on the meta device, so the loss is checked where it is made."""
    from .model_zoo import _text, gpt2

    x, y = _text(0, 4)
    pipe = dreampipe.Pipeline(
        gpt2(), example=(x, y), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=lambda out, t: F.cross_entropy(out.logits.flatten(0, 1), t.flatten(),
                                               reduction="none"),
        config=dreampipe.TrainConfig(schedule="1f1b-flush"))
    with pytest.raises(ConfigError, match=r"loss_fn returned a tensor of shape \[24\], not a "
                                          r"scalar; .*reduction='mean'"):
        pipe.step(x, y)
    with pytest.raises(WorkerError, match=r"stopped at an error \(ConfigError: loss_fn "
                                          r"returned .* make a new Pipeline, or resume"):
        pipe.step(x, y)  # the runner stopped within its schedule: nothing runs on from there
    pipe.close()  # ends it all the same


@pytest.mark.parametrize(("kw", "needle"), [
    ({"example": None}, "example=NoneType: give one minibatch as (inputs, target)"),
    ({"example": (torch.randn(4, 6),)}, "example=tuple: give one minibatch"),
    ({"example": (torch.randn(4, 6), 3)}, "example=tuple: give one minibatch"),
    ({"optimizer": None}, "optimizer=None: give a function of a stage's parameters"),
    ({"variable_dims": (5,)}, "variable_dims=(5,): the example's tensors have dimensions "
                              "0..1, none 5"),
])
def test_a_missing_example_or_optimizer_or_a_dimension_it_lacks_is_one_error(
    kw: dict[str, Any], needle: str
) -> None:
    """Each names the argument and the fix before anything runs (no traceback from deep
    inside), and a variable dimension the example does not have is not a silent no-op."""
    with pytest.raises(ConfigError) as info:
        _pipe(**kw)
    assert needle in str(info.value)

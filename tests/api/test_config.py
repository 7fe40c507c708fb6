"""``TrainConfig``: each rule once, with its message; settings files; the JSON round trip."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe import ScheduleKind, TrainConfig
from dreampipe.errors import ConfigError
from dreampipe.runplan.schedule_choice import Semantics
from dreampipe.runtime.block_recompute import BlockRecompute
from dreampipe.runtime.nonfinite import OnNonFinite
from dreampipe.runtime.precision import Precision

__all__: list[str] = []


@pytest.mark.parametrize(("kw", "message", "fields"), [
    ({"schedule": "1f1b"}, "schedule='1f1b'; use one of pipedream, 1f1b-flush, gpipe",
     ("schedule",)),
    ({"semantics": "eventual"}, "semantics='eventual'; use one of sync, async", ("semantics",)),
    ({"on_nonfinite": "ignore"}, "on_nonfinite='ignore'; use one of stop, skip",
     ("on_nonfinite",)),
    ({"precision": "fp8"}, "precision='fp8'; use one of fp32, bf16-mixed, bf16, fp16-mixed",
     ("precision",)),
    ({"precision": "bf16-mix"}, "precision='bf16-mix'; use one of fp32, bf16-mixed, bf16, "
     "fp16-mixed (nearest: bf16-mixed)", ("precision",)),
    ({"autocast": torch.bfloat16}, "autocast=torch.bfloat16 is precision='bf16-mixed' now: "
     "TrainConfig(precision='bf16-mixed')", ("autocast", "precision")),
    ({"autocast": "float16"}, "autocast='float16' is precision='fp16-mixed' now",
     ("autocast", "precision")),
    ({"loss_scale": 1024.0}, "loss_scale=1024.0, loss_scale_window=2000 with precision=fp32: "
     "only fp16-mixed scales the loss", ("loss_scale", "precision")),
    ({"precision": "fp16-mixed", "schedule": "gpipe", "loss_scale": 0.0},
     "loss_scale=0.0, loss_scale_window=2000; use a positive scale (e.g. 65536)",
     ("loss_scale", "loss_scale_window")),
    ({"precision": "fp16-mixed", "schedule": "gpipe", "loss_scale_window": 0},
     "loss_scale=65536.0, loss_scale_window=0; use a positive scale (e.g. 65536) and a window "
     "of 1 or more updates", ("loss_scale", "loss_scale_window")),
    ({"recompute_blocks": 2, "recompute_attention": True}, "recompute_blocks=2 with "
     "recompute_attention=True; recompute either each stage's first k >= 1 blocks or every "
     "block's attention, not both", ("recompute_blocks", "recompute_attention")),
    ({"recompute_blocks": -1}, "recompute_blocks=-1: the blocks each stage recomputes, from "
     "its first; use 0 (none) or more", ("recompute_blocks",)),
    ({"precision": "fp16-mixed", "schedule": "2bw"}, "precision=fp16-mixed with schedule=2bw: "
     "a loss scale shared by all stages needs every stage to update at the same step",
     ("precision", "schedule")),
    ({"microbatches": "4"}, "microbatches='4': microbatches takes a whole number",
     ("microbatches",)),
    ({"microbatches": 2.0}, "microbatches=2.0: microbatches takes a whole number",
     ("microbatches",)),
    ({"stash": 1}, "stash=1: stash takes True or False", ("stash",)),
    ({"timeout_s": True}, "timeout_s=True: timeout_s takes a number", ("timeout_s",)),
    ({"virtual_stages": "2"}, "virtual_stages='2': virtual_stages takes a whole number or None",
     ("virtual_stages",)),
    ({"resume": 3}, "resume=3; give a checkpoint directory", ("resume",)),
    ({"schedule_file": 3, "schedule": "gpipe"}, "schedule_file=3; give a CSV file",
     ("schedule_file",)),
    ({"schedule_file": "pp.csv"}, "schedule_file='pp.csv' with schedule=pipedream: a PyTorch "
     "schedule is one synchronous step of unreplicated stages; name its kind",
     ("schedule_file", "schedule")),
    ({"schedule_file": "pp.csv", "schedule": "auto"}, "schedule_file='pp.csv' with "
     "schedule=auto", ("schedule_file", "schedule")),
    ({"schedule_file": "pp.csv", "schedule": "dp"}, "schedule_file='pp.csv' with schedule=dp",
     ("schedule_file", "schedule")),
    ({"timeout_s": 0}, "timeout_s=0; use a positive number of seconds", ("timeout_s",)),
    ({"timeout_s": float("nan")}, "timeout_s=nan; use a positive number", ("timeout_s",)),
    ({"max_grad_norm": -1}, "max_grad_norm=-1; use a positive norm, or None not to clip",
     ("max_grad_norm",)),
    ({"max_grad_norm": float("inf")}, "max_grad_norm=inf; use a positive norm",
     ("max_grad_norm",)),
    ({"virtual_stages": 2}, "virtual_stages=2 with schedule=pipedream; use 1, or "
                            "schedule=interleaved-1f1b with 2 or more",
     ("virtual_stages", "schedule")),
    ({"virtual_stages": 0, "schedule": "interleaved-1f1b"}, "virtual_stages=0; a worker runs "
                                                            "1 stage or more",
     ("virtual_stages",)),
    ({"virtual_stages": -1}, "virtual_stages=-1; a worker runs 1 stage or more: use 1",
     ("virtual_stages",)),
    ({"virtual_stages": 2, "schedule": "auto"}, "virtual_stages=2 with schedule=auto; use 1",
     ("virtual_stages", "schedule")),
    ({"variable_dims": (1, 1)}, "variable_dims=(1, 1); give the dimensions that may change "
     "from step to step, each once, as indices from 0, e.g. variable_dims=(1,)",
     ("variable_dims",)),
    ({"variable_dims": (-1,)}, "variable_dims=(-1,); give the dimensions", ("variable_dims",)),
    ({"variable_dims": 1}, "variable_dims=1; give the dimensions", ("variable_dims",)),
    ({"variable_dims": (True,)}, "variable_dims=(True,); give the dimensions",
     ("variable_dims",)),
    ({"virtual_stages": 1, "schedule": "zbv"}, "virtual_stages=1 with schedule=zbv, which runs "
     "2 stages on each worker, in a V; use virtual_stages=2, or leave it out",
     ("virtual_stages", "schedule")),
    ({"virtual_stages": 3, "schedule": "dualpipev"}, "virtual_stages=3 with schedule=dualpipev",
     ("virtual_stages", "schedule")),
    ({"microbatches": 0}, "microbatches=0; use 1 or more", ("microbatches",)),
    ({"microbatches": 4}, "microbatches=4 with schedule=pipedream: PipeDream updates after "
                          "every minibatch", ("microbatches", "schedule")),
    ({"schedule": "gpipe", "vertical_sync": True},
     "vertical_sync=True with schedule=gpipe: vertical sync and turning weight stashing off "
     "apply to the pipedream schedule only; use schedule=pipedream, or drop vertical_sync=True",
     ("vertical_sync", "stash", "schedule")),
    ({"schedule": "2bw", "stash": False}, "stash=False with schedule=2bw",
     ("vertical_sync", "stash", "schedule")),
    ({"vertical_sync": True, "stash": False},
     "vertical_sync=True runs every stage on a stashed weight version, so it needs weight "
     "stashing; drop stash=False or vertical_sync=True", ("stash", "vertical_sync")),
    ({"on_nonfinite": "skip"}, "on_nonfinite=skip needs every stage to update at the same step",
     ("on_nonfinite", "schedule")),
    ({"schedule": "auto", "vertical_sync": True},
     "schedule=auto with semantics=sync chooses among zb-h1, zb-h2, 1f1b-flush, gpipe, and none "
     "of them can run this: vertical_sync=True with schedule=zb-h1",
     ("vertical_sync", "stash", "schedule", "semantics")),
])
def test_each_rule_names_the_value_and_the_fix(kw: dict[str, Any], message: str,
                                               fields: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**kw)
    assert str(info.value).startswith(message), str(info.value)
    assert info.value.parameters == fields


def test_a_rule_about_the_schedule_waits_for_the_one_auto_chooses() -> None:
    config = TrainConfig(schedule="auto", semantics="async", vertical_sync=True)  # pipedream may
    assert (config.kind, config.chooses) == (ScheduleKind.TWO_BW, Semantics.ASYNC)
    assert config.chosen(ScheduleKind.PIPEDREAM, 1).kind is ScheduleKind.PIPEDREAM
    with pytest.raises(ConfigError, match="vertical_sync=True with schedule=2bw"):
        config.chosen(ScheduleKind.TWO_BW, 4)
    skip = TrainConfig(schedule="auto", semantics="async", on_nonfinite="skip")
    with pytest.raises(ConfigError, match="on_nonfinite=skip needs every stage to update"):
        skip.chosen(ScheduleKind.PIPEDREAM, 1)
    assert TrainConfig(schedule="auto").kind is ScheduleKind.FLUSH
    assert TrainConfig(schedule="gpipe").chooses is None
    either = TrainConfig(schedule="auto", semantics="any", vertical_sync=True)
    assert (either.kind, either.chooses) == (ScheduleKind.FLUSH, Semantics.ANY)
    assert either.chosen(ScheduleKind.PIPEDREAM, 1).kind is ScheduleKind.PIPEDREAM


def test_values_are_kept_by_name_whatever_was_given() -> None:
    config = TrainConfig(schedule=ScheduleKind.FLUSH, semantics=Semantics.ASYNC,  # type: ignore[arg-type]
                         on_nonfinite=OnNonFinite.SKIP, precision=Precision.BF16_MIXED,  # type: ignore[arg-type]
                         resume=Path("ck"), timeout_s=5, max_grad_norm=2)
    assert (config.schedule, config.semantics, config.on_nonfinite, config.precision,
            config.resume) == ("1f1b-flush", "async", "skip", "bf16-mixed", "ck")
    assert isinstance(config.timeout_s, float) and config.max_grad_norm == 2.0
    assert dataclasses.replace(config, schedule_file=Path("pp.csv")).schedule_file == "pp.csv"
    assert config == TrainConfig(schedule="1f1b-flush", semantics="async", on_nonfinite="skip",
                                 precision="bf16-mixed", resume="ck", timeout_s=5.0,
                                 max_grad_norm=2.0)
    assert config.number_formats is Precision.BF16_MIXED and config.policy is OnNonFinite.SKIP
    dims = TrainConfig(variable_dims=[2, 0])  # type: ignore[arg-type]  # as JSON gives it
    assert dims.variable_dims == (0, 2) and dims.runner_options().varying_shapes
    assert not config.runner_options().varying_shapes
    opts = config.runner_options()
    assert (opts.precision.autocast, opts.max_grad_norm, opts.timeout_s) == (
        torch.bfloat16, 2.0, 5.0)
    fp16 = TrainConfig(precision="fp16-mixed", loss_scale=1024, loss_scale_window=10,
                       schedule="gpipe").runner_options()
    assert (fp16.precision, fp16.loss_scale, fp16.loss_scale_window) == (
        Precision.FP16_MIXED, 1024.0, 10)
    assert repr(TrainConfig()) == "TrainConfig()"
    assert repr(TrainConfig(microbatches=2, schedule="gpipe")) == \
        "TrainConfig(schedule='gpipe', microbatches=2)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]


def test_an_unknown_key_names_the_nearest_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'microbatch' is not a TrainConfig field; did you "
                                          r"mean 'microbatches'\?") as info:
        TrainConfig.from_dict({"schedule": "gpipe", "microbatch": 4})
    assert info.value.parameters == ("microbatch",)
    with pytest.raises(ConfigError, match=r"'zzz' is not a TrainConfig field; use schedule, "):
        TrainConfig.from_json('{"zzz": 1}')
    path = tmp_path / "s.toml"
    path.write_text('clip = 1.0\n')
    with pytest.raises(ConfigError, match=rf"settings file '{path}': 'clip' is not a "
                                          r"TrainConfig field"):
        TrainConfig.load(path)


def test_a_settings_file_with_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "s.toml"
    toml.write_text('schedule = "gpipe"\nmicrobatches = 4\nprecision = "bf16"\n')
    assert TrainConfig.load(toml, {"microbatches": 2}) == TrainConfig(
        schedule="gpipe", microbatches=2, precision="bf16")
    toml.write_text('autocast = "bfloat16"\n')  # the old key says where it went
    with pytest.raises(ConfigError, match="autocast='bfloat16' is precision='bf16-mixed' now"):
        TrainConfig.load(toml)
    # a rule is checked on the whole: the file alone would break it, the flags mend it
    toml.write_text('schedule = "gpipe"\nvertical_sync = true\n')
    assert TrainConfig.load(toml, {"schedule": "pipedream"}).vertical_sync
    js = tmp_path / "s.json"
    js.write_text(TrainConfig(schedule="zb-h1", microbatches=8, seed=4).to_json())
    assert TrainConfig.load(js) == TrainConfig(schedule="zb-h1", microbatches=8, seed=4)
    for name, text, needle in (("s.yaml", "x: 1", "name a .toml or a .json file"),
                               ("t.json", "[1]", "holds a list"),
                               ("u.json", "{", "is not valid JSON")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=needle):
            TrainConfig.load(tmp_path / name)


@st.composite
def _valid(draw: st.DrawFn) -> TrainConfig:
    """Any valid config: the knobs a schedule constrains drawn within its rules."""
    schedule = draw(st.sampled_from([*(k.value for k in ScheduleKind), "auto"]))
    pipedream = schedule == "pipedream"
    synchronous = schedule not in ("pipedream", "2bw", "auto")
    stash = draw(st.booleans()) if pipedream else True
    many = st.integers(1, 4) if schedule == "interleaved-1f1b" else st.just(
        2 if schedule in ("zbv", "dualpipev") else 1)
    return TrainConfig(
        schedule=schedule, semantics=draw(st.sampled_from(["sync", "async", "any"])),
        microbatches=1 if pipedream else draw(st.integers(1, 64)),
        virtual_stages=draw(st.none() | many),
        max_grad_norm=draw(st.none() | st.floats(1e-6, 1e6)),
        precision=draw(st.sampled_from([p.value for p in Precision if p is not
                                        Precision.FP16_MIXED or synchronous])),
        compensate=draw(st.booleans()), stash=stash,
        vertical_sync=draw(st.booleans()) if pipedream and stash else False,
        fused_accumulation=draw(st.booleans()), seed=draw(st.integers(0, 2**63 - 1)),
        timeout_s=draw(st.floats(1e-3, 1e6) | st.just(float("inf"))),
        on_nonfinite="stop" if pipedream else draw(st.sampled_from(["stop", "skip"])),
        record_events=draw(st.booleans()),
        **draw(st.sampled_from([{}, {"recompute_attention": True}]) | st.builds(
            lambda k: {"recompute_blocks": k}, st.integers(0, 8))),
        resume=draw(st.none() | st.text(min_size=1, max_size=20)),
        schedule_file=draw(st.none() | st.text(min_size=1, max_size=20))
        if synchronous and schedule != "dp" else None,
        variable_dims=tuple(draw(st.sets(st.integers(0, 5)))),
    )


@settings(max_examples=200, deadline=None)
@given(_valid())
def test_every_valid_config_round_trips_through_json(config: TrainConfig) -> None:
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert TrainConfig.from_json(config.to_json()) == config
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert dataclasses.replace(config) == config


def test_recomputation_of_blocks_is_one_spec() -> None:
    assert TrainConfig().block_recompute() is None
    assert TrainConfig(recompute_blocks=2).block_recompute() == BlockRecompute(blocks=2)
    assert TrainConfig(recompute_attention=True).block_recompute() == \
        BlockRecompute(selective=True)


def test_the_v_schedules_take_2_stages_per_worker_and_need_them_cut() -> None:
    from dreampipe.api.checks import check_virtual

    for schedule in ("zbv", "dualpipev"):
        assert TrainConfig(schedule=schedule).virtual_stages is None
        assert TrainConfig(schedule=schedule, virtual_stages=2).kind is ScheduleKind(schedule)
        assert TrainConfig(schedule=schedule).stages_per_rank == 2
        with pytest.raises(ConfigError, match=rf"virtual_stages=2 with plan='auto' \(schedule="
                           rf"{schedule}\); give split points \(plan=\[...\]\) or a plan of "
                           r"world x 2 stages"):
            check_virtual(TrainConfig(schedule=schedule), "auto")
    assert TrainConfig(schedule="interleaved-1f1b").stages_per_rank == 1
    assert TrainConfig(schedule="interleaved-1f1b", virtual_stages=3).stages_per_rank == 3


@pytest.mark.parametrize(("fields", "agree"), [
    ({}, False), ({"max_grad_norm": 1.0}, True),
    ({"precision": "fp16-mixed", "schedule": "1f1b-flush"}, True),
    ({"precision": "bf16-mixed"}, False),
    ({"on_nonfinite": "skip", "schedule": "1f1b-flush"}, True),
])
def test_the_runs_whose_ranks_agree_before_each_update(fields: dict[str, Any], agree: bool
                                                      ) -> None:
    """Clipping, a 16-bit loss scale and skipping a non-finite minibatch each make every
    rank wait for every other before an update; the prediction prices what this says."""
    assert TrainConfig(**fields).runner_options().steps_agree is agree

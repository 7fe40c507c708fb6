"""Staleness compensation: each stage's delay, the compensated settings, and the warning."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from dreampipe.runtime.staleness import (
    Hyper,
    carry_over,
    compensate,
    compensate_stage,
    compensated,
    delay_advice,
    hyper_of,
    prediction_delays,
    predicts,
    recompensated,
    stage_delays,
)
from dreampipe.scheduling.actions import ScheduleKind as S
from dreampipe.scheduling.build import build_schedule

__all__: list[str] = []


@pytest.mark.parametrize(("momentum", "delay", "left"),
                         [(0.9, 0, 0.9), (0.9, 1, 0.4), (0.9, 3, 0.15), (0.5, 3, 0.0),
                          (0.0, 1, 0.0)])
def test_sgd_momentum_loses_the_delays_implicit_momentum_and_the_lr_stays(
    momentum: float, delay: int, left: float
) -> None:
    got = compensated(Hyper(0.05, momentum), delay)
    assert got.lr == 0.05
    assert got.momentum == pytest.approx(left)
    assert not predicts(Hyper(0.05, momentum), delay)  # SGD: its momentum, no prediction


def test_adam_keeps_its_settings_prediction_is_its_compensation() -> None:
    for delay in (0, 1, 3):
        assert compensated(Hyper(0.01, 0.9, adaptive=True), delay) == Hyper(0.01, 0.9, True)
        assert predicts(Hyper(0.01, 0.9, adaptive=True), delay) is (delay > 0)
    assert not predicts(None, 2)  # an optimizer compensation cannot read is left alone


def test_each_sgd_group_loses_the_delays_momentum_from_its_own() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    sgd = torch.optim.SGD([{"params": a.parameters()},
                           {"params": b.parameters(), "momentum": 0.2}], lr=0.1, momentum=0.9)
    compensate(sgd, 1)
    assert [g["momentum"] for g in sgd.param_groups] == [pytest.approx(0.4), 0.0]


def test_a_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="delay=-1"):
        compensated(Hyper(0.1, 0.9), -1)


def _params() -> list[nn.Parameter]:
    return list(nn.Linear(2, 2).parameters())


def test_sgd_groups_are_compensated_in_place_adamw_groups_kept() -> None:
    sgd = torch.optim.SGD(_params(), lr=0.05, momentum=0.9)
    assert compensate(sgd, 1) == ((Hyper(0.05, 0.9), Hyper(0.05, pytest.approx(0.4))),)
    assert sgd.param_groups[0]["momentum"] == pytest.approx(0.4)
    adamw = torch.optim.AdamW(_params(), lr=3e-3, betas=(0.9, 0.98))
    assert compensate(adamw, 3) == (None,)
    assert (adamw.param_groups[0]["betas"], adamw.param_groups[0]["lr"]) == ((0.9, 0.98), 3e-3)


def test_no_delay_or_no_momentum_setting_changes_nothing() -> None:
    sgd = torch.optim.SGD(_params(), lr=0.05, momentum=0.9)
    assert compensate(sgd, 0) == (None,)
    assert sgd.param_groups[0]["momentum"] == 0.9
    adagrad = torch.optim.Adagrad(_params(), lr=0.1)
    assert hyper_of(adagrad.param_groups[0]) is None
    assert compensate(adagrad, 3) == (None,)


def _optimizer(adaptive: bool, lr: float, momentum: float) -> torch.optim.Optimizer:
    if adaptive:
        return torch.optim.AdamW(_params(), lr=lr, betas=(momentum, 0.99))
    return torch.optim.SGD(_params(), lr=lr, momentum=momentum)


@given(adaptive=st.booleans(), lr=st.floats(1e-4, 1.0), momentum=st.floats(0.0, 0.99),
       saved_delay=st.integers(0, 4), delay=st.integers(0, 4), scheduled=st.floats(0.0, 1.0),
       cycled=st.floats(0.0, 0.99))
def test_a_group_carried_over_to_another_delay_is_compensated_as_if_built_for_it(
    adaptive: bool, lr: float, momentum: float, saved_delay: int, delay: int, scheduled: float,
    cycled: float
) -> None:
    """The rate keeps what a scheduler did to it; the momentum is what a scheduler last
    set (``cycled``, as OneCycleLR does), compensated for the new delay, as the run that
    went on without a stop has it; and the record says so."""
    old, new = _optimizer(adaptive, lr, momentum), _optimizer(adaptive, lr, momentum)
    compensate(old, saved_delay)
    now = compensate(new, delay)[0]
    group = {k: v for k, v in old.param_groups[0].items() if k != "params"}
    group["lr"] *= scheduled  # what a scheduler did to the saving run's rate carries over
    saved = recompensated(_with_momentum(group, cycled), None, saved_delay)
    went_on = recompensated(_with_momentum(dict(group), cycled), None, delay)
    record = carry_over(group, saved, now, delay)
    assert group["lr"] == pytest.approx(lr * scheduled, rel=1e-9, abs=1e-15)
    got = group["betas"][0] if adaptive else group["momentum"]
    assert got == pytest.approx(cycled if went_on is None else went_on[1].momentum)
    assert record == went_on


def _with_momentum(group: dict[str, Any], momentum: float) -> dict[str, Any]:
    """``group`` with its momentum (SGD's, or Adam's ``beta1``) set to ``momentum``."""
    if "betas" in group:
        group["betas"] = (momentum, *group["betas"][1:])
    else:
        group["momentum"] = momentum
    return group


def test_a_group_without_compensation_carries_over_unchanged() -> None:
    group = {"lr": 0.3, "momentum": 0.7, "initial_lr": 0.5}
    assert carry_over(group, None, None, None) is None
    assert group == {"lr": 0.3, "momentum": 0.7, "initial_lr": 0.5}


def test_a_scheduler_that_gives_momentum_to_a_group_built_without_it_is_compensated() -> None:
    """SGD built with momentum 0 is left as it is; when OneCycleLR then sets 0.95, a
    stage 3 updates stale trains with 0.95 - 3/4."""
    group = {"lr": 0.1, "momentum": 0.0}
    assert recompensated(group, None, 3) is None
    group["momentum"] = 0.95
    record = recompensated(group, None, 3)
    assert group["momentum"] == pytest.approx(0.2)
    assert record == (Hyper(0.1, 0.95), Hyper(0.1, group["momentum"]))
    assert recompensated(group, record, 3) == record  # nothing moved it since


def test_a_one_element_tensor_rate_is_read_as_its_value() -> None:
    """A capturable optimizer's tensor learning rate: compensation still applies, and
    leaves the user's tensor in place."""
    lr = torch.tensor(0.125)  # exact in float32
    group = {"lr": lr, "momentum": 0.9}
    assert hyper_of(group) == Hyper(0.125, 0.9)
    param = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([param], lr=lr, momentum=0.9)
    assert compensate(sgd, 1)[0] is not None
    assert sgd.param_groups[0]["lr"] is lr
    assert sgd.param_groups[0]["momentum"] == pytest.approx(0.4)


def test_delays_follow_the_schedule() -> None:
    assert stage_delays(build_schedule([1] * 4, S.PIPEDREAM, 16)) == (3, 2, 1, 0)
    assert stage_delays(build_schedule([1] * 4, S.PIPEDREAM, 16), vertical_sync=True) == (3,) * 4
    assert stage_delays(build_schedule([1] * 4, S.TWO_BW, 12, 3)) == (1,) * 4
    assert stage_delays(build_schedule([1] * 4, S.FLUSH, 12, 3)) == (0,) * 4
    # a replicated stage counts its own updates (one per round of its 2 replicas)
    assert stage_delays(build_schedule([2, 1], S.PIPEDREAM, 16)) == (2, 0)


def test_only_a_delayed_stage_of_an_asynchronous_stashed_compensated_adam_run_predicts() -> None:
    adam, sgd = Hyper(1e-3, 0.9, adaptive=True), Hyper(0.05, 0.9)
    pipedream = build_schedule([1] * 4, S.PIPEDREAM, 16)
    on = {"vertical_sync": False, "compensate": True, "stash": True}
    assert prediction_delays(pipedream, adam, **on) == (3, 2, 1, 0)
    assert prediction_delays(pipedream, adam, **{**on, "vertical_sync": True}) == (3,) * 4
    assert prediction_delays(build_schedule([1] * 4, S.TWO_BW, 12, 3), adam, **on) == (1,) * 4
    for schedule, hyper, off in [(pipedream, sgd, {}), (pipedream, None, {}),
                                 (pipedream, adam, {"compensate": False}),
                                 (pipedream, adam, {"stash": False}),
                                 (build_schedule([1] * 4, S.FLUSH, 12, 3), adam, {})]:
        assert prediction_delays(schedule, hyper, **{**on, **off}) == (0,) * 4


def test_advice_names_the_fix_for_the_studys_settings() -> None:
    digits = Hyper(0.05, 0.9)
    said = delay_advice(digits, 3, compensating=False)
    assert said is not None and "momentum 0.9 with gradients 3 updates stale" in said
    assert "compensate=True" in said
    assert delay_advice(digits, 3, compensating=True) is None
    assert delay_advice(digits, 0, compensating=False) is None


def test_advice_on_a_large_sgd_step_names_the_learning_rate() -> None:
    said = delay_advice(Hyper(0.4, 0.0), 3, compensating=True)
    assert said is not None and "lower the learning rate to at most 0.333" in said
    assert delay_advice(Hyper(0.2, 0.0), 3, compensating=True) is None


def test_adams_step_is_not_judged_by_its_size_but_beta1_is() -> None:
    assert delay_advice(Hyper(1.0, 0.2, adaptive=True), 3, compensating=False) is None
    said = delay_advice(Hyper(3e-3, 0.9, adaptive=True), 1, compensating=False)
    assert said is not None and "beta1 0.9" in said


def test_a_stage_is_compensated_and_the_deepest_delay_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sched = build_schedule([1] * 4, S.PIPEDREAM, 16)
    with caplog.at_level(logging.WARNING, logger="dreampipe.runtime.staleness"):
        kept = torch.optim.SGD(_params(), lr=0.05, momentum=0.9)
        compensate_stage(kept, sched, 3, vertical_sync=False, enabled=False, advise=True)
    assert kept.param_groups[0]["momentum"] == 0.9
    assert "pipedream: momentum 0.9 with gradients 3 updates stale" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dreampipe.runtime.staleness"):
        fixed = torch.optim.SGD(_params(), lr=0.05, momentum=0.9)
        compensate_stage(fixed, sched, 2, vertical_sync=False, enabled=True, advise=True)
    assert fixed.param_groups[0]["momentum"] == pytest.approx(0.4)
    assert caplog.text == ""


def test_synchronous_schedules_are_left_alone() -> None:
    sgd = torch.optim.SGD(_params(), lr=0.05, momentum=0.9)
    compensate_stage(sgd, build_schedule([1] * 4, S.FLUSH, 8, 4), 0, vertical_sync=False,
                     enabled=True, advise=True)
    assert sgd.param_groups[0]["momentum"] == 0.9


def test_uniform_compensation_gives_every_stage_the_deepest_delays_settings() -> None:
    """Weights tied across stages: each copy must take the same updates."""
    last = torch.optim.SGD(_params(), lr=0.05, momentum=0.9)
    compensate_stage(last, build_schedule([1] * 4, S.PIPEDREAM, 16), 3, vertical_sync=False,
                     enabled=True, advise=False, uniform=True)
    assert last.param_groups[0]["momentum"] == pytest.approx(0.15)


def test_the_warning_offers_2bw_only_to_pipedream(caplog: pytest.LogCaptureFixture) -> None:
    for kind, sched in ((S.PIPEDREAM, build_schedule([1] * 2, S.PIPEDREAM, 8)),
                        (S.TWO_BW, build_schedule([1] * 2, S.TWO_BW, 8, 2))):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dreampipe.runtime.staleness"):
            sgd = torch.optim.SGD(_params(), lr=0.05, momentum=0.9)
            compensate_stage(sgd, sched, 0, vertical_sync=False, enabled=False, advise=True)
        assert "gradients 1 update stale" in caplog.text
        assert ("schedule='2bw'" in caplog.text) is (kind is S.PIPEDREAM)
        assert caplog.text.rstrip().endswith("a synchronous schedule (1f1b-flush)")


def test_a_scheduler_that_cycles_momentum_is_compensated_after_each_step() -> None:
    """OneCycleLR sets the momentum at every step, over what compensation set: the stage
    follows it with the value the scheduler set, less the delay's implicit momentum; a
    scheduler that leaves the momentum alone is not compensated twice."""
    from dreampipe.api.stage_build import compensation_delays, follow_schedulers
    from dreampipe.runtime.stage_module import StageModule

    schedule = build_schedule([1, 1, 1], S.PIPEDREAM, 6)
    delay = stage_delays(schedule)[0]
    assert delay == 2
    for cycles in (True, False):
        st = StageModule(nn.Linear(3, 3), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                         stage=0, input_grad=False)
        assert st.optimizer is not None
        applied = {0: compensate_stage(st.optimizer, schedule, 0, vertical_sync=False,
                                       enabled=True, advise=False)}
        follow = follow_schedulers(applied, compensation_delays(
            schedule, [0], False, enabled=True, uniform=False))
        sched = (torch.optim.lr_scheduler.OneCycleLR(st.optimizer, max_lr=0.1, total_steps=10)
                 if cycles else torch.optim.lr_scheduler.StepLR(st.optimizer, 2))
        follow(st)
        given_seen = []
        for _ in range(5):
            pair = applied[0][0]
            assert pair is not None
            given, used = pair
            group = st.optimizer.param_groups[0]
            assert group["momentum"] == used.momentum == pytest.approx(
                max(0.0, given.momentum - 2 / 3))
            given_seen.append(given.momentum)
            st.optimizer.step()
            sched.step()
            follow(st)
        # OneCycleLR's momentum falls from 0.95 as its rate rises; StepLR's stays the user's
        assert given_seen[0] == pytest.approx(0.95 if cycles else 0.9)
        assert (given_seen[-1] < given_seen[0]) == cycles

"""What a plan should reach on this machine (:mod:`dreampipe.runplan.prediction`)."""

from __future__ import annotations

from typing import Any

import pytest
from machine.fixtures import DEV_MACHINE

from dreampipe.machine.calibration import local_topology
from dreampipe.machine.measure import local_machine
from dreampipe.runplan.plan_choice import PlanAsk, choose_plan
from dreampipe.runplan.prediction import predict_samples_per_s
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout
from runplan.toy_graphs import toy_graph

__all__: list[str] = []


def test_prediction_matches_a_balanced_pipeline() -> None:
    graph = toy_graph([6.0] * 4)
    plan = choose_plan(graph, local_topology(2, local_machine(2)),
                       PlanAsk(workers=2, stages="0,2")).plan
    steps = 200
    rate = predict_samples_per_s(graph, plan, MicrobatchLayout(
        kind=ScheduleKind.PIPEDREAM, minibatch_size=32, microbatches=1), steps, local_machine(2))
    # the slower stage: each runs two layers plus the host time local costs charge
    # per minibatch (slowed by a busy neighbour): its forward's overhead, its data
    # (samples or labels), the SGD step of its 8 MiB of weights and one send; the
    # last stage adds the loss, the first the copy its step makes of the weights
    # that the minibatch in flight still holds (weight stashing)
    m = DEV_MACHINE
    weights = 2 * 4 * 1024 * 1024
    common_s = (2 * 6.0 / 1e3 + m.stage_forward_s + m.batch_load_s
                + weights / m.step_bandwidth)
    first_s, last_s = common_s + weights / m.stash_copy_bandwidth, common_s + m.loss_s
    send_s = m.send_overhead_s + 4 * 32 * 1024 / m.send_copy_bandwidth
    one_stage_s = max(first_s, last_s) * m.corun_slowdown + send_s
    assert first_s > last_s
    assert rate == pytest.approx(32 / one_stage_s, rel=0.05)




#: A plain SGD step of a stage of the toy pipeline below (2 layers of 4 MiB), slowed as
#: its neighbour computes.
_STEP_S = 2 * 4 * 1024 * 1024 / DEV_MACHINE.step_bandwidth * DEV_MACHINE.corun_slowdown


def _two_stages(last_ms: float = 6.0, **options: Any) -> float:
    """Samples/s predicted for 200 minibatches of 32 through two stages of two layers, of
    6 ms on the first and ``last_ms`` on the last, under PipeDream's schedule, with
    ``options`` for the prediction."""
    graph = toy_graph([6.0, 6.0, last_ms, last_ms])
    machine = local_machine(2)
    plan = choose_plan(graph, local_topology(2, machine), PlanAsk(workers=2, stages="0,2")).plan
    layout = MicrobatchLayout(kind=ScheduleKind.PIPEDREAM, minibatch_size=32, microbatches=1)
    return predict_samples_per_s(graph, plan, layout, 200, machine, **options)


def test_a_clipped_run_steps_twice_as_long_and_agrees_before_each_update() -> None:
    """Clipping moves each gradient's bytes as a plain SGD step moves the weights', so
    a step takes twice its time; the agreement it needs holds the stages to each other."""
    alone, steps_twice, clipped = (_two_stages(steps_agree=agree, clips=clips)
                                   for agree, clips in ((False, False), (False, True),
                                                        (True, True)))
    step_s = _STEP_S
    assert 32 / steps_twice - 32 / alone == pytest.approx(step_s, rel=0.05)
    assert clipped < 0.8 * steps_twice  # two equal stages: about B0 + F1 + B1 a minibatch


def test_an_optimizer_that_steps_k_plain_steps_adds_k_minus_one_step_times() -> None:
    """The prediction prices a step by a plain SGD step's traffic; an optimizer measured at
    ``k`` times that (Adam's moments, momentum's buffer) takes ``k`` of them, and clipping
    one more."""
    plain, adam, clipped = (_two_stages(step_factor=k, clips=clips)
                            for k, clips in ((1.0, False), (4.0, False), (4.0, True)))
    assert 32 / adam - 32 / plain == pytest.approx(3 * _STEP_S, rel=0.05)
    assert 32 / clipped - 32 / adam == pytest.approx(_STEP_S, rel=0.05)


def test_weight_prediction_is_priced_on_the_delayed_stages_only() -> None:
    """Under PipeDream the first of two stages runs one update stale and predicts its
    weights; the last is not delayed and does not. ``k`` plain steps of prediction on the
    first stage, the bottleneck once it predicts, add ``k`` step times a minibatch. Where
    the last stage is the slower by more than that, prediction changes nothing, unless
    vertical sync delays the last stage too."""
    plain, predicted = (_two_stages(step_factor=4.0, prediction_factor=k) for k in (0.0, 3.0))
    assert 32 / predicted - 32 / plain == pytest.approx(3 * _STEP_S, rel=0.05)
    plain, first, both = (_two_stages(12.0, prediction_factor=k, vertical_sync=sync)
                          for k, sync in ((0.0, False), (3.0, False), (3.0, True)))
    assert first == pytest.approx(plain, rel=0.01)
    assert 32 / both - 32 / plain == pytest.approx(3 * _STEP_S, rel=0.05)


def test_a_synchronous_schedule_predicts_nothing() -> None:
    graph = toy_graph([6.0] * 4)
    machine = local_machine(2)
    plan = choose_plan(graph, local_topology(2, machine), PlanAsk(workers=2, stages="0,2")).plan
    layout = MicrobatchLayout(kind=ScheduleKind.FLUSH, minibatch_size=32,
                              microbatches=4)
    rates = [predict_samples_per_s(graph, plan, layout, 50, machine, prediction_factor=k)
             for k in (0.0, 5.0)]
    assert rates[0] == rates[1]

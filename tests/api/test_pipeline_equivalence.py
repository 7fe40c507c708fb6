"""Multi-process Pipeline runs against the single-process references (docs/design.md §5).

The same rules as ``tests/runtime/test_equivalence.py``, reached through the
public API: the user's model (the zoo's 4-layer mlp built whole), data fed
minibatch by minibatch, a user optimizer factory.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from runtime.reference import adamw, reference_pipedream, reference_sync, reference_two_bw, sgd
from runtime.reference_formats import Formats

from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset
from dreampipe.runtime.processes import run_processes

from .compare import assert_matches, assert_within_rounding
from .workers import train_zoo

__all__: list[str] = []

SEED = 3


def _run_all(world: int, **job: Any) -> list[Any]:
    return run_processes(train_zoo, world, {"seed": SEED, **job}, deadline_s=90.0)


def _run(world: int, **job: Any) -> dict[str, Any]:
    out = _run_all(world, **job)
    assert isinstance(out[0], dict)
    return out[0]


SYNC = [("1f1b-flush", [0, 2], [1, 1], 4)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("schedule", "bounds", "replicas", "micro"), SYNC,
                         ids=[f"{c[0]}-{'-'.join(map(str, c[2]))}" for c in SYNC])
def test_sync_schedules_through_the_api_equal_gradient_accumulation(
    schedule: str, bounds: list[int], replicas: list[int], micro: int
) -> None:
    got = _run(sum(replicas), schedule=schedule, bounds=bounds, replicas=replicas, steps=3,
               minibatch=16, microbatches=micro, lr=0.2)
    spec = get_model("mlp", layers=4, width=16)
    microbatches = micro * sum(replicas) if schedule == "dp" else micro
    losses, state = reference_sync(spec, load_dataset("synthetic", spec, seed=SEED), steps=3,
                                   minibatch=16, seed=SEED, opt=sgd(0.2), microbatches=microbatches)
    assert_matches(got, losses, state)


PIPE = [([0, 1, 3], [1, 1, 1], True, True, "momentum"), ([0, 2], [2, 1], False, True, "momentum"),
        ([0, 2], [2, 1], False, False, "momentum"), ([0, 1, 3], [1, 1, 1], False, True, "adamw"),
        ([0, 1, 3], [1, 1, 1], True, True, "adamw"), ([0, 2], [2, 1], False, True, "adamw")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("bounds", "replicas", "vsync", "compensate", "optimizer"), PIPE,
                         ids=["straight-3-vsync", "replicated-2-1", "replicated-2-1-uncompensated",
                              "straight-3-adamw-predicted", "straight-3-vsync-adamw-predicted",
                              "replicated-2-1-adamw-predicted"])
def test_pipedream_through_the_api_matches_the_delayed_update_rule(
    bounds: list[int], replicas: list[int], vsync: bool, compensate: bool, optimizer: str
) -> None:
    """SGD's momentum lowered by each stage's delay; AdamW's stages on predicted weights."""
    lr = 0.01 if optimizer == "adamw" else 0.3
    # 5 minibatches: the replicated stage ends on a partial round of one
    got = _run(sum(replicas), schedule="pipedream", bounds=bounds, replicas=replicas, steps=5,
               minibatch=8, lr=lr, momentum=0.9, vertical_sync=vsync, compensate=compensate,
               optimizer=optimizer)
    spec = get_model("mlp", layers=4, width=16)
    losses, state = reference_pipedream(
        spec, load_dataset("synthetic", spec, seed=SEED), bounds=bounds, replicas=replicas,
        steps=5, minibatch=8, seed=SEED,
        opt=adamw(lr) if optimizer == "adamw" else sgd(0.3, 0.9), vertical_sync=vsync,
        partial_round=True, compensate=compensate,
    )
    assert_matches(got, losses, state)


TWO_BW = [([0, 2], [1, 1], "sgd", False, 2), ([0, 1, 3], [1, 1, 1], "momentum", False, 2),
          ([0, 2], [2, 1], "adamw", False, 2), ([0, 1, 3], [1, 1, 1], "momentum", True, 2),
          ([0, 2], [2, 1], "adamw", True, 2), ([0, 2], [1, 2], "momentum", False, 4),
          ([0, 2], [2, 1], "adamw", True, 4)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("bounds", "replicas", "optimizer", "compensate", "micro"), TWO_BW,
                         ids=["straight-2-sgd", "straight-3-momentum", "replicated-2-1-adamw",
                              "straight-3-momentum-compensated",
                              "replicated-2-1-adamw-compensated",
                              "replicated-1-2-momentum-steps-deferred",
                              "replicated-2-1-adamw-compensated-steps-deferred"])
def test_2bw_through_the_api_matches_its_update_rule(
    bounds: list[int], replicas: list[int], optimizer: str, compensate: bool, micro: int
) -> None:
    """W(t+1) = W(t) - lr * grad f(W(t-1)) with the user's optimizer (its momentum lowered
    by 1/2 when compensated), a replicated stage summing its replicas' microbatches into
    the one update of every minibatch; with 2 microbatches a replica, its step deferred
    past backwards of the next minibatch, whose gradients stay the next update's."""
    lr = 0.01 if optimizer == "adamw" else 0.3
    momentum = 0.9 if optimizer == "momentum" else 0.0
    got = _run(sum(replicas), schedule="2bw", bounds=bounds, replicas=replicas, steps=6,
               minibatch=16, microbatches=micro, lr=lr, momentum=momentum, optimizer=optimizer,
               compensate=compensate)
    spec = get_model("mlp", layers=4, width=16)
    opt = adamw(lr) if optimizer == "adamw" else sgd(lr, momentum)
    losses, state = reference_two_bw(spec, load_dataset("synthetic", spec, seed=SEED), steps=6,
                                     minibatch=16, seed=SEED, opt=opt, microbatches=micro,
                                     compensate=compensate)
    assert_matches(got, losses, state)


CAPPED = [([0, 2], [1, 1], 3, 3), ([0, 2], [2, 1], 3, 2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("bounds", "replicas", "segment_microbatches", "cap"), CAPPED,
                         ids=["straight-2", "replicated-2-1"])
def test_pipedream_drains_a_full_segment_as_finish_would(
    bounds: list[int], replicas: list[int], segment_microbatches: int, cap: int
) -> None:
    """A segment of ``cap`` minibatches (whole rounds of the replicated stage) drains.

    Seven steps with the cap trains exactly as seven steps with ``finish()``
    every ``cap`` steps, and no schedule ever holds more than the cap, while
    the uncapped run's grew past it. Rank 0's updates (one per round of its
    stage's replicas) are numbered over the whole run.
    """
    job = {"schedule": "pipedream", "bounds": bounds, "replicas": replicas, "steps": 7,
           "minibatch": 8, "lr": 0.3, "momentum": 0.9}
    capped = _run(sum(replicas), segment_microbatches=segment_microbatches, record_events=True,
                  **job)
    finished = _run(sum(replicas), finish_every=cap, **job)
    assert capped["longest"] <= cap < finished["longest"]
    assert capped["updates"] == list(range(math.ceil(7 / replicas[0])))
    assert capped["losses"] == finished["losses"]
    for name, value in finished["state"].items():
        assert torch.equal(capped["state"][name], value), name


@pytest.mark.timeout(120)
def test_sync_segments_drained_by_the_cap_train_as_one() -> None:
    """1F1B with a flush drains at every update anyway: the cap changes nothing."""
    got = _run(2, schedule="1f1b-flush", bounds=[0, 2], replicas=[1, 1], steps=5,
               minibatch=16, microbatches=4, lr=0.2, segment_microbatches=8)
    assert got["longest"] <= 8
    spec = get_model("mlp", layers=4, width=16)
    losses, state = reference_sync(spec, load_dataset("synthetic", spec, seed=SEED), steps=5,
                                   minibatch=16, seed=SEED, opt=sgd(0.2), microbatches=4)
    assert_matches(got, losses, state)


@pytest.mark.timeout(150)
def test_a_receive_posted_ahead_for_another_replica_holds_back_no_link() -> None:
    """2 then 3 replicas, 4 microbatches an update, ``finish()`` after the first step: on
    gloo stage 1's second replica posts the second update's receives ahead, one from a
    stage-0 replica it has not heard from yet (a header's receive); the next segment deals
    that microbatch round-robin to another replica, so the receive is never taken, and
    must not hold back the link's next header (in the segment's second update). Trains
    as gradient accumulation."""
    got = _run(5, schedule="1f1b-flush", bounds=[0, 2], replicas=[2, 3], steps=3,
               minibatch=16, microbatches=4, lr=0.2, finish_after=[1])
    spec = get_model("mlp", layers=4, width=16)
    losses, state = reference_sync(spec, load_dataset("synthetic", spec, seed=SEED), steps=3,
                                   minibatch=16, seed=SEED, opt=sgd(0.2), microbatches=4)
    assert_matches(got, losses, state)


AHEAD = [([0, 2], [1, 1], False, 2), ([0, 2], [2, 1], False, 3), ([0, 1, 3], [1, 1, 1], True, 2)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("bounds", "replicas", "vsync", "every"), AHEAD,
                         ids=["straight-2", "replicated-2-1", "straight-3-vsync"])
def test_receives_posted_ahead_change_nothing_across_drains_and_evaluations(
    bounds: list[int], replicas: list[int], vsync: bool, every: int
) -> None:
    """On gloo, after each step the last stage has the next minibatch's receive posted
    (comm.py, "posting ahead"); without posting ahead it has not. Seven steps with a
    ``finish()`` and an ``evaluate()`` every ``every`` steps train bit for bit alike
    either way: a receive a drain leaves posted is taken by the next segment, or set
    aside where the round-robin gives its microbatch to the other replica (2-1, drains
    every 3), and the evaluations' traffic never meets it."""
    job = {"schedule": "pipedream", "bounds": bounds, "replicas": replicas, "steps": 7,
           "minibatch": 8, "lr": 0.3, "momentum": 0.9, "vertical_sync": vsync,
           "finish_every": every, "evaluate": 5}
    ahead = _run_all(sum(replicas), **job)
    plain = _run_all(sum(replicas), post_ahead=False, **job)
    assert ahead[-1]["ahead"] == [True] * 7
    assert plain[-1]["ahead"] == [False] * 7
    assert len(ahead[0]["evals"]) == 7 // every
    assert ahead[0]["evals"] == plain[0]["evals"]
    assert ahead[0]["losses"] == plain[0]["losses"]
    for name, value in plain[0]["state"].items():
        assert torch.equal(ahead[0]["state"][name], value), name


ASYNC_16 = [("pipedream", "bf16"), ("pipedream", "bf16-mixed"), ("2bw", "bf16"),
            ("2bw", "bf16-mixed")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("schedule", "precision"), ASYNC_16,
                         ids=[f"{s}-{p}" for s, p in ASYNC_16])
def test_the_asynchronous_schedules_follow_their_rule_in_16_bits(schedule: str,
                                                                 precision: str) -> None:
    """A replicated stage, SGD with momentum lowered by each stage's delay: pipedream's
    and 2bw's delayed updates in bf16 (master weights) and bf16-mixed, within 16-bit
    rounding of their references in that precision
    (:func:`.compare.assert_within_rounding`; Adam would turn rounding into whole steps
    of its learning rate, a bound too loose to catch a lost gradient)."""
    lr, steps = 0.3, 6
    micro = 2 if schedule == "2bw" else 1
    minibatch = 16 if schedule == "2bw" else 8
    got = _run(3, schedule=schedule, bounds=[0, 2], replicas=[2, 1], steps=steps,
               minibatch=minibatch, microbatches=micro, lr=lr, momentum=0.9,
               optimizer="momentum", precision=precision)
    spec = get_model("mlp", layers=4, width=16)

    def reference(formats: Formats) -> tuple[list[float], dict[str, torch.Tensor]]:
        data = load_dataset("synthetic", spec, seed=SEED)
        if schedule == "2bw":
            return reference_two_bw(spec, data, steps=steps, minibatch=minibatch, seed=SEED,
                                    opt=sgd(lr, 0.9), microbatches=micro, compensate=True,
                                    formats=formats)
        return reference_pipedream(spec, data, bounds=[0, 2], replicas=[2, 1], steps=steps,
                                   minibatch=minibatch, seed=SEED, opt=sgd(lr, 0.9),
                                   partial_round=True, compensate=True, formats=formats)

    start = spec.build(0, spec.num_layers - 1, SEED).state_dict()
    assert_within_rounding(got, reference(Formats(precision)), reference(Formats()), start)

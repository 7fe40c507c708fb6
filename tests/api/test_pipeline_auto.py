"""``schedule="auto"``: the Pipeline simulates the schedules of the semantics asked for on
its plan and trains with the fastest; a synchronous choice still trains as one process."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from runtime.reference import reference_sync, sgd
from torch import nn

from dreampipe.api import Pipeline, TrainConfig
from dreampipe.api.plans import Resolved, resolve_plan
from dreampipe.errors import ConfigError, DatasetError
from dreampipe.runplan import schedule_choice
from dreampipe.runplan.schedule_choice import CANDIDATES, Semantics, microbatch_counts
from dreampipe.runtime.processes import free_port, run_processes
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.microbatch_layout import default_microbatches
from dreampipe.splitter.chain import split_layers

from .compare import assert_matches
from .model_workers import train_case
from .model_zoo import CASES, CaseData, CaseSpec
from .test_pipeline_errors import _pipe

__all__: list[str] = []

SEED = 3


def _run(**job: Any) -> dict[str, Any]:
    out = run_processes(train_case, 2, {"seed": SEED, "case": "resnet", "minibatch": 8,
                                        "lr": 0.1, "schedule": "auto", **job}, deadline_s=90.0)
    assert isinstance(out[0], dict)
    return out[0]


@pytest.mark.timeout(120)
def test_auto_sync_picks_a_synchronous_schedule_that_trains_as_one_process() -> None:
    got = _run(semantics="sync", steps=3, microbatches=2)
    assert got["schedule"] in {k.value for k in CANDIDATES[Semantics.SYNC]}
    case = CASES["resnet"]
    losses, state = reference_sync(CaseSpec(case, SEED), CaseData(case), steps=3,  # type: ignore[arg-type]
                                   minibatch=8, seed=SEED, opt=sgd(0.1), microbatches=2)
    assert_matches(got, losses, state)


@pytest.mark.timeout(120)
def test_auto_async_picks_an_asynchronous_schedule_and_trains() -> None:
    got = _run(semantics="async", steps=4, microbatches=2)
    assert got["schedule"] in {k.value for k in CANDIDATES[Semantics.ASYNC]}
    assert len(got["losses"]) == 4 and all(math.isfinite(x) for x in got["losses"])


@pytest.mark.parametrize(("kw", "needle"), [
    ({"schedule": "auto", "semantics": "eventual"}, r"semantics='eventual'; use one of sync, "),
    ({"schedule": "auto", "virtual_stages": 2}, r"virtual_stages=2 with schedule=auto; use 1"),
])
def test_auto_with_what_it_cannot_choose_names_the_fix(kw: dict[str, Any], needle: str
                                                       ) -> None:
    with pytest.raises(ConfigError, match=needle):
        _pipe(**kw)


def _resolved(config: TrainConfig, microbatch_size: int) -> Resolved:
    """In a group of one, the profile and the choice happen here."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        layers = split_layers(model, x[:microbatch_size])
        return resolve_plan("auto", layers=layers, example=(x, y), loss_fn=F.cross_entropy,
                            microbatch_size=microbatch_size, config=config)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("semantics", list(Semantics))
def test_the_plan_comes_back_with_the_schedule_the_simulator_chose(semantics: Semantics
                                                                   ) -> None:
    """The choice is one of the semantics' candidates with its microbatches, never the
    stand-in left unchosen."""
    config = TrainConfig(schedule="auto", semantics=semantics.value, microbatches=2)
    got = _resolved(config, 4)
    assert got.kind in CANDIDATES[semantics]
    assert got.microbatches == (1 if got.kind is ScheduleKind.PIPEDREAM else 2)
    assert got.plan.num_stages == 1


def test_microbatches_left_out_are_the_search_s_own() -> None:
    """Left out, the choice simulates each count that divides the minibatch in whole rounds
    of replicas, up to GPipe's 4 a stage, and keeps the fastest (on one worker, one
    microbatch: more only add each one's fixed costs)."""
    got = _resolved(TrainConfig(schedule="auto", semantics="sync"), 8)
    assert got.kind in CANDIDATES[Semantics.SYNC]
    replicas = [st.replicas for st in got.plan.stages]
    assert got.microbatches in microbatch_counts(replicas, 8)
    assert max(microbatch_counts(replicas, 8)) == default_microbatches(replicas)


def test_a_minibatch_shorter_than_the_microbatches_auto_chose_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The samples a minibatch needs are the chosen microbatches', not the stand-in's
    (1) before the choice: fewer would leave a microbatch empty, whose mean is NaN. (The
    search is held to 4 microbatches, which one worker would not choose itself.)"""
    monkeypatch.setattr(schedule_choice, "microbatch_counts", lambda replicas, batch: (4,))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        pipe = Pipeline(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)),
                        example=(torch.randn(8, 6), torch.randint(0, 3, (8,))),
                        loss_fn=F.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        plan="auto", config=TrainConfig(schedule="auto", semantics="sync",
                                                        variable_dims=(0,), timeout_s=30.0))
        chosen = pipe.layout.microbatches_per_update
        assert chosen > 1
        with pytest.raises(DatasetError, match=f"fewer than its {chosen} microbatches"):
            pipe.step(torch.randn(chosen - 1, 6), torch.randint(0, 3, (chosen - 1,)))
        pipe.close()
    finally:
        dist.destroy_process_group()

"""Plans whose stages recompute (``r``) train on 2 ranks as the same plans without it:
1f1b-flush equals one process, pipedream the delayed-update rule (the backward runs the
forward again on the microbatch's stashed version)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from runtime.reference import reference_pipedream, reference_sync, sgd

from dreampipe.planning.plan import Plan
from dreampipe.runtime.processes import run_processes
from dreampipe.splitter.chain import split_layers
from dreampipe.splitter.segments import split_bounds

from .compare import assert_matches
from .model_workers import train_case
from .model_zoo import CASES, CaseData, CaseSpec
from .test_pipeline_models import SEED, TIED_KEYS, assert_tied_equal

__all__: list[str] = []


def _recomputing_plan(name: str) -> Plan:
    case = CASES[name]
    model = CaseSpec(case, SEED).model()
    names = [n for n, _ in split_layers(model, case.example(0, 1)[0])]
    plan = Plan.from_config(len(names), split_bounds(names, case.split_points, model), [1, 1],
                            layer_names=tuple(names))
    return dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(st, recompute=True) for st in plan.stages))


def _run(**job: Any) -> dict[str, Any]:
    out = run_processes(train_case, 2, {"seed": SEED, **job}, deadline_s=90.0)
    assert isinstance(out[0], dict)
    return out[0]


@pytest.mark.timeout(120)
def test_a_recomputing_resnet_with_batchnorm_under_1f1b_flush_equals_one_process() -> None:
    got = _run(case="resnet", schedule="1f1b-flush", steps=3, minibatch=8, microbatches=2,
               lr=0.1, plan=_recomputing_plan("resnet"))
    losses, state = reference_sync(CaseSpec(CASES["resnet"], SEED), CaseData(CASES["resnet"]),  # type: ignore[arg-type]
                                   steps=3, minibatch=8, seed=SEED, opt=sgd(0.1), microbatches=2)
    assert got["recomputes"]
    assert_matches(got, losses, state)


@pytest.mark.timeout(120)
def test_recomputing_gpt2_under_pipedream_follows_the_delayed_updates() -> None:
    got = _run(case="gpt2", schedule="pipedream", steps=4, minibatch=8, lr=0.1, momentum=0.9,
               plan=_recomputing_plan("gpt2"))
    losses, state = reference_pipedream(
        CaseSpec(CASES["gpt2"], SEED, microbatch=8), CaseData(CASES["gpt2"]),  # type: ignore[arg-type]
        bounds=got["bounds"], replicas=[1, 1], steps=4, minibatch=8, seed=SEED,
        opt=sgd(0.1, 0.9), compensate=True,
        ties=[[(0, a), (1, b)] for a, b in TIED_KEYS["gpt2"]])
    assert got["recomputes"]
    assert_matches(got, losses, state)
    assert_tied_equal("gpt2", got)

"""Models as people write them, trained through the Pipeline on 2 ranks, against the
single-process references: 1f1b-flush equals gradient accumulation, pipedream equals
the delayed-update rule (tests/runtime/reference.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from runtime.reference import reference_pipedream, reference_sync, sgd

from dreampipe.runtime.processes import run_processes

from .compare import assert_matches
from .model_workers import train_case
from .model_zoo import CASES, CaseData, CaseSpec

__all__: list[str] = []

SEED = 5


def _run(**job: Any) -> dict[str, Any]:
    out = run_processes(train_case, 2, {"seed": SEED, **job}, deadline_s=90.0)
    assert isinstance(out[0], dict)
    return out[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(CASES))
def test_1f1b_flush_of_a_model_split_at_its_modules_equals_one_process(name: str) -> None:
    got = _run(case=name, schedule="1f1b-flush", steps=3, minibatch=8, microbatches=2, lr=0.1)
    spec = CaseSpec(CASES[name], SEED)
    assert got["bounds"][1] > 0
    losses, state = reference_sync(spec, CaseData(CASES[name]), steps=3,  # type: ignore[arg-type]
                                   minibatch=8, seed=SEED, opt=sgd(0.1), microbatches=2)
    assert_matches(got, losses, state)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(set(CASES) - {"tied"}))
def test_pipedream_of_a_model_split_at_its_modules_follows_the_delayed_updates(
    name: str
) -> None:
    got = _run(case=name, schedule="pipedream", steps=4, minibatch=8, lr=0.1, momentum=0.9)
    spec = CaseSpec(CASES[name], SEED)
    losses, state = reference_pipedream(
        spec, CaseData(CASES[name]), bounds=got["bounds"], replicas=[1, 1],  # type: ignore[arg-type]
        steps=4, minibatch=8, seed=SEED, opt=sgd(0.1, 0.9))
    assert_matches(got, losses, state)


@pytest.mark.timeout(120)
def test_pipedream_keeps_the_copies_of_a_tied_weight_equal_and_trains() -> None:
    got = _run(case="tied", schedule="pipedream", steps=12, minibatch=8, lr=0.2)
    assert got["bounds"] == [0, 3]
    torch.testing.assert_close(got["state"]["head.weight"], got["state"]["embed.weight"],
                               rtol=0, atol=0)
    assert sum(got["losses"][-3:]) < sum(got["losses"][:3])

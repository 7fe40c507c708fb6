"""study_warning: what the convergence study says before an asynchronous run trains."""

from __future__ import annotations

import pytest
import torch

from dreampipe import TrainConfig
from dreampipe.api.stage_build import agreement_note, study_warning
from dreampipe.scheduling.actions import ScheduleKind as S
from dreampipe.scheduling.build import build_schedule

__all__: list[str] = []

_WEIGHTS = [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize(("optimizer", "kind", "stages", "warns"), [
    (torch.optim.AdamW(_WEIGHTS, lr=3e-3), S.PIPEDREAM, 4, "never reached"),  # chars at 4
    (torch.optim.Adam(_WEIGHTS, lr=1e-3), S.TWO_BW, 4, "never reached"),  # gpt2 at 4
    (torch.optim.SGD(_WEIGHTS, lr=0.05, momentum=0.9), S.PIPEDREAM, 8, "needed 2.00x"),
    (torch.optim.SGD(_WEIGHTS, lr=0.05, momentum=0.9), S.PIPEDREAM, 4, None),  # digits
    (torch.optim.SGD(_WEIGHTS, lr=0.05, momentum=0.9), S.TWO_BW, 2, "needed 2.00x"),
    (torch.optim.AdamW(_WEIGHTS, lr=3e-3), S.FLUSH, 4, None),
    (torch.optim.Adagrad(_WEIGHTS), S.PIPEDREAM, 4, "never reached"),  # no family: all rows
])
def test_the_study_s_failing_rows_warn_before_training(
        optimizer: torch.optim.Optimizer, kind: S, stages: int, warns: str | None) -> None:
    m = 1 if kind is S.PIPEDREAM else 2
    schedule = build_schedule([1] * stages, kind, 4 * m, m)
    said = study_warning(optimizer, schedule)
    if warns is None:
        assert said is None
    else:
        assert said is not None and warns in said and "schedule='1f1b-flush'" in said


@pytest.mark.parametrize(("kind", "stages", "fields", "notes"), [
    (S.PIPEDREAM, 2, {"max_grad_norm": 1.0}, True),
    (S.TWO_BW, 3, {"max_grad_norm": 1.0}, True),
    (S.PIPEDREAM, 2, {}, False),
    (S.FLUSH, 2, {"max_grad_norm": 1.0}, False),  # a flush waits anyway
    (S.PIPEDREAM, 1, {"max_grad_norm": 1.0}, False),  # nothing to wait for
])
def test_an_asynchronous_run_that_agrees_before_each_update_is_told_its_cost(
        kind: S, stages: int, fields: dict[str, float], notes: bool) -> None:
    m = 1 if kind is S.PIPEDREAM else stages
    schedule = build_schedule([1] * stages, kind, 4 * m, m)
    said = agreement_note(None if kind.synchronous else schedule,
                          TrainConfig(schedule=kind.value, microbatches=m,
                                      **fields).runner_options())
    assert (said is not None) is notes
    if said is not None:
        assert said.startswith(f"{kind.value} with max_grad_norm") and "wait" in said

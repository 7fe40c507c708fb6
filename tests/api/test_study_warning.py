"""study_warning: what the convergence study says before an asynchronous run trains."""

from __future__ import annotations

import pytest
import torch

from dreampipe.api.stage_build import study_warning
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

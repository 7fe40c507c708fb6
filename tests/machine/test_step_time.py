"""How many plain SGD steps' time a run's optimizer takes (:mod:`dreampipe.machine.step_time`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dreampipe.machine.step_time import prediction_factor, step_factor

__all__: list[str] = []


@pytest.mark.timing  # measured step times: alone on the cores (make test)
def test_adams_step_is_several_plain_steps_and_sgds_about_one() -> None:
    """A plain SGD step reads a weight and its gradient and writes the weight; Adam also
    reads and writes two moments and makes temporaries: several times the traffic (on a
    noisy host the bounds are wide, but a factor priced at 1 fails them)."""
    adam = step_factor(lambda params: torch.optim.Adam(params, lr=1e-3))
    momentum = step_factor(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    assert adam > 3.0
    assert momentum > 1.2
    assert adam > momentum


def test_a_factory_that_cannot_step_the_probes_is_priced_as_plain_sgd(
        caplog: pytest.LogCaptureFixture) -> None:
    def named(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        raise TypeError("wants named parameter groups")

    with caplog.at_level("INFO"):
        assert step_factor(named) == 1.0
    assert "stepping probes failed (TypeError: wants named parameter groups)" in caplog.text


@pytest.mark.timing  # measured step times: alone on the cores (make test)
def test_weight_prediction_costs_more_than_a_plain_step() -> None:
    """A delayed stage's prediction copies its weights before the step, takes their change
    after it (two passes) and extrapolates a new version (reads two, writes one): over
    twice a plain step's traffic. Priced at 0, as a probe that never predicted would be,
    it fails."""
    assert prediction_factor() > 1.5

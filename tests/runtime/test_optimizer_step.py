"""An optimizer step's temporaries, measured on the optimizer itself, and what they add to
a stage's predicted peak."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from dreampipe.profiling.tensor_bytes import TensorBytes
from dreampipe.runtime.optimizer_step import (
    NO_STEP_BYTES,
    StepBytes,
    measure_step_bytes,
    stage_step_bytes,
)

_MAKERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-decay": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "sgd-decay-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=1e-4,
                                                    foreach=True),
}


def _stepped(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
             sizes: tuple[int, ...]) -> int:
    """The most bytes a second step holds beyond the optimizer's state, counted apart from
    the module's own probes: parameters of ``sizes`` elements, each a gradient of ones."""
    params = [nn.Parameter(torch.randn(n)) for n in sizes]
    optimizer = make(params)
    peak = 0
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        tracker = TensorBytes("cpu")
        with tracker.counting(), torch.no_grad():
            optimizer.step()
        tracker.close()
        peak = tracker.peak
    return peak


@pytest.mark.parametrize("name", list(_MAKERS))
def test_the_measured_rule_bounds_a_step_over_unlike_parameters(name: str) -> None:
    """Fitted on equal probes, the rule holds, as a bound within a parameter's size, on
    parameters of other sizes and counts (a model's weights and biases)."""
    rule = measure_step_bytes(_MAKERS[name])
    for sizes in ((5000, 20), (3000, 9000, 700), (4096,) * 6, (12000, 4000, 4000, 8)):
        measured = _stepped(_MAKERS[name], sizes)
        bound = rule.of([4 * n for n in sizes])
        assert measured <= bound + 64, (name, sizes, measured, bound)
        assert bound - measured <= 4 * max(sizes) + 64, (name, sizes, measured, bound)


def test_each_form_of_adam_measures_as_it_runs() -> None:
    """Single-tensor Adam: two temporaries the size of the parameter it is on, beside the
    last one's denominator; foreach: one the size of them all; fused: none."""
    assert measure_step_bytes(_MAKERS["adam"]) == StepBytes(largest=2.0, second=1.0)
    assert measure_step_bytes(_MAKERS["adam-foreach"]) == StepBytes(total=1.0)
    assert measure_step_bytes(_MAKERS["adam-fused"]) == NO_STEP_BYTES
    assert measure_step_bytes(_MAKERS["sgd-momentum"]) == NO_STEP_BYTES


def test_an_optimizer_that_cannot_step_the_probes_counts_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    def from_model(model: nn.Module) -> torch.optim.Optimizer:  # wants a module, not a list
        return torch.optim.SGD(model.parameters(), lr=0.1)

    with caplog.at_level("INFO"):
        assert measure_step_bytes(from_model) == NO_STEP_BYTES
    assert "stepping probes failed" in caplog.text


def test_a_stage_steps_its_masters_and_its_shard() -> None:
    rule = StepBytes(largest=2.0, second=1.0)
    assert stage_step_bytes(rule, [400, 100, 300], master_weights=False) == 1100
    assert stage_step_bytes(rule, [400, 100, 300], master_weights=True) == 2200 + 1600
    assert stage_step_bytes(rule, [400, 100, 300], master_weights=False, shards=2) == 550

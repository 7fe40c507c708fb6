"""The overlap hook: each half of an overlapped pair runs exactly once, whatever the hook."""

from __future__ import annotations

import pytest
from torch import nn

from dreampipe.errors import ConfigError
from dreampipe.runtime.overlap import (
    OverlappedPair,
    model_hook,
    one_after_the_other,
    run_pair,
)

__all__: list[str] = []


def _pair(ran: list[str]) -> OverlappedPair:
    return OverlappedPair(0, 3, nn.Identity(), 1, 1, nn.Identity(),
                          lambda: ran.append("F"), lambda: ran.append("B"))


def test_the_default_runs_the_forward_then_the_backward() -> None:
    ran: list[str] = []
    run_pair(one_after_the_other, _pair(ran))
    assert ran == ["F", "B"]


def test_a_hook_may_run_them_in_either_order() -> None:
    ran: list[str] = []
    run_pair(lambda pair: (pair.run_backward(), pair.run_forward()), _pair(ran))
    assert ran == ["B", "F"]


@pytest.mark.parametrize(("hook", "counts"), [
    (lambda pair: pair.run_forward(), "1 time(s) and the backward of microbatch 1 (stage 1) 0"),
    (lambda pair: (pair.run_forward(), pair.run_forward(), pair.run_backward()),
     "2 time(s) and the backward of microbatch 1 (stage 1) 1"),
])
def test_a_hook_that_skips_or_repeats_a_half_is_an_error(hook: object, counts: str) -> None:
    ran: list[str] = []
    with pytest.raises(ConfigError, match=r"call pair\.run_forward") as caught:
        run_pair(hook, _pair(ran))  # type: ignore[arg-type]
    assert f"ran the forward of microbatch 3 (stage 0) {counts} time(s)" in str(caught.value)
    assert ran.count("F") == 1  # a repeat does not run it twice


def test_a_model_brings_its_own_hook_as_its_overlap_pair_method() -> None:
    class Model(nn.Module):
        def overlap_pair(self, pair: OverlappedPair) -> None:
            pair.run_backward()
            pair.run_forward()

    model = Model()
    ran: list[str] = []
    run_pair(model_hook(model), _pair(ran))
    assert ran == ["B", "F"]
    assert model_hook(nn.Identity()) is one_after_the_other
    odd = nn.Identity()
    odd.overlap_pair = 3  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"the model's overlap_pair is 3; give it a method"):
        model_hook(odd)

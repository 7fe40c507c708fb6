"""fp16's loss scale follows torch.amp.GradScaler's rule, bit for bit."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.runtime.loss_scaling import LossScale

__all__: list[str] = []


@settings(max_examples=40, deadline=None)
@given(overflows=st.lists(st.booleans(), min_size=1, max_size=30),
       window=st.integers(1, 4), initial=st.sampled_from([1.0, 3.0, 2.0**16, 1e5]))
def test_the_scale_moves_as_gradscalers_does(overflows: list[bool], window: int,
                                             initial: float) -> None:
    ours = LossScale(initial, window)
    theirs = torch.amp.GradScaler("cpu", init_scale=initial, growth_interval=window)
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=1.0)
    for bad in overflows:
        g = torch.tensor([1.0, float("inf") if bad else 2.0, 3.0])
        scaled = theirs.scale(g)  # the same product as ours
        assert torch.equal(scaled, g * ours.value)
        param.grad = scaled.clone()
        mine = [scaled.clone()]
        finite = ours.unscale(mine)
        assert finite is not bad
        theirs.step(opt)
        theirs.update()
        ours.update(not finite)
        assert ours.value == theirs.get_scale()
        assert param.grad is not None  # GradScaler unscaled it in place, as we did ours
        torch.testing.assert_close(mine[0], param.grad, rtol=0, atol=0, equal_nan=True)


def test_the_state_round_trips() -> None:
    scale = LossScale(1024.0, 3)
    scale.update(False)
    scale.update(True)
    scale.update(False)
    again = LossScale(1.0, 3)
    again.load_state_dict(scale.state_dict())
    assert again.state_dict() == scale.state_dict() == {"scale": 512.0, "good": 1}


def test_a_resume_with_a_shorter_window_past_its_count_grows_at_the_next_update() -> None:
    saved = LossScale(1.0, 8)
    for _ in range(5):
        saved.update(False)
    shorter = LossScale(1.0, 4)
    shorter.load_state_dict(saved.state_dict())
    shorter.update(False)  # 6 finite updates in a row: past the window of 4
    assert shorter.state_dict() == {"scale": 2.0, "good": 0}

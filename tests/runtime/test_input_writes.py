"""``runtime/input_writes.py``: a stage whose forward writes its input in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dreampipe.errors import ConfigError
from dreampipe.runtime.stage_module import StageModule

__all__: list[str] = []


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _stage() -> nn.Sequential:
    """A cut before a torchvision-style ``ReLU(inplace=True)``: the stage writes its input."""
    torch.manual_seed(0)
    return nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 3))


def test_a_stage_that_writes_its_input_trains_as_one_process() -> None:
    """In one process the ReLU writes the layer before's output, a non-leaf; the stage's
    input is a leaf that requires grad, so it runs on a copy, whose gradient reaches it."""
    torch.manual_seed(1)
    xs, gs = [torch.randn(4, 6) for _ in range(3)], [torch.randn(4, 3) for _ in range(3)]
    stage = StageModule(_stage(), _sgd, stage=1, input_grad=True)
    got = []
    for u, x in enumerate(xs):
        stage.forward(u, x.clone())
    for u, g in enumerate(gs):
        got.append(stage.backward(u, g))
    stage.step()
    ref = _stage()
    want = []
    for x, g in zip(xs, gs, strict=True):
        leaf = x.clone().requires_grad_(True)
        ref(leaf * 1.0).backward(g)  # the layer before's output: a non-leaf
        want.append(leaf.grad)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the stage adds each microbatch's weight gradient by one fused GEMM (runtime/fused.py),
    # autograd by a product and a sum: float32 equal, bit for bit on some kernel sets only
    for a, b in zip(stage.module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)


class _DrawsThenWrites(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand_like(x)
        return x.mul_(2.0) + noise


def test_a_write_after_a_random_draw_is_refused_not_run_twice() -> None:
    """Running it again on a copy would draw other random numbers than one process."""
    stage = StageModule(nn.Sequential(_DrawsThenWrites(), nn.Linear(6, 3)), _sgd, stage=1,
                        input_grad=True)
    with pytest.raises(ConfigError, match=r"stage 1's forward writes its input in place after "
                                          r"it drew random numbers"):
        stage.forward(0, torch.randn(4, 6))

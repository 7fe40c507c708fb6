"""Zero Bubble's B/W split gives the fused backward's input and weight gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dreampipe.runtime.fused import LinearGradients
from dreampipe.runtime.stage_module import StageModule

__all__: list[str] = []


class _Block(nn.Module):
    """LayerNorm, a residual, a GELU MLP and a weight used twice: paths that cross."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 6)
        self.gate = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down(nn.functional.gelu(self.up(self.norm(x)))) * self.gate
        return h * self.gate.tanh()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), nn.Conv1d(3, 3, 1), _Block())


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("mode", list(LinearGradients))
@pytest.mark.parametrize("input_grad", [True, False])
def test_b_then_w_equals_one_backward(mode: LinearGradients, input_grad: bool) -> None:
    """Microbatches' B's first, their W's later and out of order: the input gradients, the
    weight gradients summed over the microbatches and the update match the fused backward."""
    ref = StageModule(_model(), _sgd, stage=1, input_grad=input_grad, linear=mode)
    split = StageModule(_model(), _sgd, stage=1, input_grad=input_grad, linear=mode)
    torch.manual_seed(1)
    xs = [torch.randn(2, 3, 6) for _ in range(3)]
    gs = [torch.randn(2, 3, 6) for _ in range(3)]
    for _ in range(2):
        ref_in = []
        for u, (x, g) in enumerate(zip(xs, gs, strict=True)):
            ref.forward(u, x.clone())
            ref_in.append(ref.backward(u, g))
        split_in = []
        for u, x in enumerate(xs):
            split.forward(u, x.clone())
        for u, g in enumerate(gs):
            split_in.append(split.backward_input(u, g))
            if u == 1:
                split.backward_weight(1)
        if input_grad:
            assert all(p.grad is None for p in split.params), "B wrote a weight gradient"
        split.backward_weight(2)
        split.backward_weight(0)
        for a, b in zip(ref_in, split_in, strict=True):
            if input_grad:
                assert a is not None and b is not None
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
            else:
                assert a is None and b is None
        for name, a, b in zip(ref.module_param_names, ref.gradients(), split.gradients(),
                              strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
        ref.step()
        split.step()
    for a, b in zip(ref.params, split.params, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert split.versions_held == 0


def test_the_last_stage_splits_its_loss() -> None:
    """On the last stage B starts from the (scaled) loss, with no output gradient."""
    def build() -> StageModule:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 3))
        return StageModule(net, _sgd, stage=1, input_grad=True,
                           loss_fn=nn.functional.cross_entropy)
    ref, split = build(), build()
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])
    ref.forward(0, x.clone(), target=y, scale=0.5)
    gin = ref.backward(0)
    split.forward(0, x.clone(), target=y, scale=0.5)
    sin = split.backward_input(0)
    assert gin is not None and sin is not None
    torch.testing.assert_close(sin, gin)
    split.backward_weight(0)
    for a, b in zip(ref.gradients(), split.gradients(), strict=True):
        torch.testing.assert_close(b, a)

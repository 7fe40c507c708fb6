"""A recomputing stage (the plan's ``r``) trains as one that keeps its activations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dreampipe.runtime.fused import LinearGradients
from dreampipe.runtime.stage_module import StageModule

__all__: list[str] = []


def _model() -> nn.Sequential:
    """Dropout (random), BatchNorm (buffers a forward updates) and Linears (fused)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.GELU(), nn.Dropout(0.3),
                         nn.Linear(12, 6))


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(stage: StageModule, split: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three microbatches' forwards (one random stream), then their backwards; twice."""
    data = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 6, generator=data) for _ in range(3)]
    gs = [torch.randn(4, 6, generator=data) for _ in range(3)]
    torch.manual_seed(2)
    outs, grads = [], []
    for _ in range(2):
        for u, x in enumerate(xs):
            outs.append(stage.forward(u, x.clone()))
        for u, g in enumerate(gs):
            if split:
                grads.append(stage.backward_input(u, g))
                stage.backward_weight(u)
            else:
                grads.append(stage.backward(u, g))
        stage.step()
    return outs, [*grads, *stage.params, *stage.module.buffers()]


@pytest.mark.parametrize("mode", list(LinearGradients))
@pytest.mark.parametrize("split", [False, True], ids=["fused", "b-then-w"])
def test_recomputing_gives_the_same_outputs_gradients_weights_and_buffers(
        mode: LinearGradients, split: bool) -> None:
    kept = StageModule(_model(), _sgd, stage=1, input_grad=True, linear=mode)
    again = StageModule(_model(), _sgd, stage=1, input_grad=True, linear=mode, recompute=True)
    want_out, want = _train(kept, split)
    got_out, got = _train(again, split)
    for a, b in zip([*want_out, *want], [*got_out, *got], strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert again.versions_held == 0


def test_a_recomputing_stage_keeps_no_graph_between_forward_and_backward() -> None:
    stage = StageModule(_model(), _sgd, stage=1, input_grad=True, recompute=True)
    out = stage.forward(0, torch.randn(4, 6))
    assert out.grad_fn is None and not out.requires_grad
    assert stage.backward(0, torch.ones(4, 6)) is not None

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


class _Shift(nn.Module):
    """Writes its input in place first thing, as a stage starting with an in-place op."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.sub_(0.25))


@pytest.mark.parametrize("stage", [0, 1], ids=["model-input", "received"])
def test_a_forward_that_writes_its_input_is_refused_where_it_runs_again(stage: int) -> None:
    """Run again in the backward on its kept input, the forward would read the written one
    (gradients off by 6e-3 in a 3-step run): refused by name, on the first microbatch."""
    from dreampipe.errors import ConfigError

    again = StageModule(_Shift(), _sgd, stage=stage, input_grad=stage > 0, recompute=True)
    with pytest.raises(ConfigError, match=rf"stage {stage}'s forward writes its input in place"):
        again.forward(0, torch.randn(4, 6))
    unstashed = StageModule(_Shift(), _sgd, stage=stage, input_grad=stage > 0, stash=False)
    with pytest.raises(ConfigError, match=r"make that op out of place"):
        unstashed.forward(0, torch.randn(4, 6))

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


def test_a_forward_that_writes_the_model_input_is_refused_where_it_runs_again() -> None:
    """Run again in the backward on its kept input, the first stage's forward would read
    the written one (gradients off by 6e-3 in a 3-step run): refused by name, on the first
    microbatch."""
    from dreampipe.errors import ConfigError

    again = StageModule(_Shift(), _sgd, stage=0, input_grad=False, recompute=True)
    with pytest.raises(ConfigError, match=r"stage 0's forward writes its input in place"):
        again.forward(0, torch.randn(4, 6))
    unstashed = StageModule(_Shift(), _sgd, stage=0, input_grad=False, stash=False)
    with pytest.raises(ConfigError, match=r"make that op out of place"):
        unstashed.forward(0, torch.randn(4, 6))


@pytest.mark.parametrize("how", ["recompute", "no-stash"])
def test_a_later_stage_that_writes_its_input_runs_again_on_a_copy(how: str) -> None:
    """A later stage's forward without autograd would write the input it receives, which
    its backward's second run reads: it runs on a copy, found by its first forward, and
    trains as one process, where the forward writes the layer before's output."""
    torch.manual_seed(1)
    xs, gs = [torch.randn(4, 6) for _ in range(3)], [torch.randn(4, 6) for _ in range(3)]
    torch.manual_seed(0)
    stage = StageModule(_Shift(), _sgd, stage=1, input_grad=True,
                        **({"recompute": True} if how == "recompute" else {"stash": False}))
    torch.manual_seed(0)
    ref = _Shift()
    got, want = [], []
    for u, x in enumerate(xs):
        kept = x.clone()
        stage.forward(u, kept)
        assert torch.equal(kept, x)  # the input it keeps is the input it got
    for u, g in enumerate(gs):
        got.append(stage.backward(u, g))
    stage.step()
    for x, g in zip(xs, gs, strict=True):
        leaf = x.clone().requires_grad_(True)
        ref(leaf * 1.0).backward(g)
        want.append(leaf.grad)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the stage adds each microbatch's weight gradient by one fused GEMM (runtime/fused.py),
    # autograd by a product and a sum: float32 equal, bit for bit on some kernel sets only
    for a, b in zip(stage.module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)

"""Fused Linear gradient accumulation equals autograd's accumulated gradients."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dreampipe.runtime.fused import fuse_linear_gradients

__all__: list[str] = []


class _Sink:
    def __init__(self, n: int) -> None:
        self.grads: list[Tensor | None] = [None] * n

    def add_grad_mm(self, index: int, a: Tensor, b: Tensor) -> None:
        g = a @ b
        acc = self.grads[index]
        self.grads[index] = g if acc is None else acc + g

    def add_grad(self, index: int, g: Tensor) -> None:
        acc = self.grads[index]
        self.grads[index] = g if acc is None else acc + g


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3, bias=False))


def test_fused_layers_accumulate_the_same_gradients() -> None:
    plain, fused = _model(), _model()
    names = [n for n, _ in fused.named_parameters()]
    sink = _Sink(len(names))
    assert fuse_linear_gradients(fused, names, sink) == 2
    xs = [torch.randn(2, 6, 4) for _ in range(3)]
    for x in xs:
        plain(x).square().sum().backward()
        xin = x.clone().requires_grad_(True)
        fused(xin).square().sum().backward()
        xref = x.clone().requires_grad_(True)
        plain_in = _model()
        plain_in(xref).square().sum().backward()
        torch.testing.assert_close(xin.grad, xref.grad)
    for (name, p), g in zip(plain.named_parameters(), sink.grads, strict=True):
        assert g is not None, name
        torch.testing.assert_close(g, p.grad, msg=name)
    assert all(p.grad is None for p in fused.parameters())


def test_layers_with_parameters_outside_the_list_keep_autograd() -> None:
    model = _model()
    sink = _Sink(1)
    assert fuse_linear_gradients(model, ["0.weight"], sink) == 0
    model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_stage_can_keep_autograd_for_its_linear_layers() -> None:
    """``fused_accumulation=False`` leaves every layer alone and makes the same update."""
    from dreampipe.runtime.stage import StageModule

    stages = [
        StageModule(_model(), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=0,
                    input_grad=False, fused_accumulation=fused)
        for fused in (True, False)
    ]
    torch.manual_seed(2)
    xs = [torch.randn(5, 4) for _ in range(3)]
    for st in stages:
        for u, x in enumerate(xs):
            st.forward(u, x)
            st.backward(u, torch.ones(5, 3))
        st.step()
    fused, plain = (st.module for st in stages)
    assert "forward" in vars(fused[0]) and "forward" not in vars(plain[0])
    for (name, a), b in zip(fused.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    assert not torch.equal(plain[0].weight, _model()[0].weight), "the step changed the weights"


def test_a_held_backward_returns_the_input_gradient_before_the_weight_gemms() -> None:
    """``hold=True``: the weight GEMMs wait for :meth:`run_held` (or the next backward
    or step), then the gradients and the update equal the plain order bit for bit."""
    from dreampipe.runtime.stage import StageModule

    stages = [
        StageModule(_model(), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=1, input_grad=True)
        for _ in range(2)
    ]
    torch.manual_seed(3)
    xs = [torch.randn(5, 4) for _ in range(3)]
    ins = []
    for hold, st in zip((False, True), stages, strict=True):
        grads_in = []
        for u, x in enumerate(xs):
            st.forward(u, x.clone())
            grads_in.append(st.backward(u, torch.ones(5, 3), hold=hold))
            if hold and u == 0:
                assert all(g is None for g in st._grads[::2]), "weight GEMMs ran early"
                st.run_held()
                assert all(g is not None for g in st._grads), "run_held left a GEMM"
        ins.append(grads_in)
        st.step()
    for a, b in zip(*ins, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(stages[0].module.parameters(), stages[1].module.parameters(), strict=True):
        assert torch.equal(a, b)

"""Fused Linear gradient accumulation equals autograd's accumulated gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dreampipe.runtime.fused import GradientSum, LinearGradients, fuse_linear_gradients
from dreampipe.runtime.stage_module import StageModule

__all__: list[str] = []


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3, bias=False))


def test_fused_layers_accumulate_the_same_gradients() -> None:
    plain, fused = _model(), _model()
    names = [n for n, _ in fused.named_parameters()]
    sink = GradientSum(list(fused.parameters()), fused=True)
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
    for (name, p), g in zip(plain.named_parameters(), sink.take(), strict=True):
        assert g is not None, name
        torch.testing.assert_close(g, p.grad, msg=name)
    assert all(p.grad is None for p in fused.parameters())


@pytest.mark.parametrize("fused", [True, False])
def test_a_gradient_sum_keeps_its_first_term_and_starts_afresh_after_take(fused: bool) -> None:
    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(3))]
    sums = GradientSum(params, fused=fused)
    first = torch.ones(2, 3)
    sums.add_grad(0, first)
    sums.add_grad_mm(0, torch.full((2, 1), 2.0), torch.ones(1, 3))
    assert sums[0] is first, "the first term is the buffer, not a copy"
    assert torch.equal(first, torch.full((2, 3), 3.0))
    assert sums[1] is None
    zeros = sums.filled(1)
    assert torch.equal(zeros, torch.zeros(3)) and sums[1] is zeros
    taken = sums.take()  # zeros nothing added to are no gradient (the next test)
    assert len(taken) == 2 and taken[0] is first and taken[1] is None
    assert sums[0] is None and sums[1] is None


@pytest.mark.parametrize("fused", [True, False])
def test_a_parameter_no_replica_reached_has_no_gradient(fused: bool) -> None:
    params = [nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))]
    sums = GradientSum(params, fused=fused)
    sums.add_grad_mm(0, torch.ones(2, 1), torch.ones(1, 2))
    sums.filled(1)  # zeros for a norm or an all-reduce: still no gradient
    assert sums.used() == {0}
    got = sums.take()
    assert got[0] is not None and got[1] is None
    assert sums.used() == frozenset()
    sums.filled(0)
    sums.filled(1)
    sums.arrive([1])  # another replica used 1: the sum's zeros count; none used 0
    assert [g is not None for g in sums.take()] == [False, True]
    assert sums.take() == [None, None]
    sums.add_grad(1, torch.ones(2))
    sums.pop(1)  # ZeRO-2 hands a microbatch's gradient on: it was still used
    assert sums.used() == {1}


def test_layers_with_parameters_outside_the_list_keep_autograd() -> None:
    model = _model()
    sink = GradientSum([model[0].weight], fused=True)
    assert fuse_linear_gradients(model, ["0.weight"], sink) == 0
    model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def test_every_way_of_making_linear_gradients_makes_the_same_update() -> None:
    """FUSED and PLAIN take over the Linear layers, AUTOGRAD leaves them alone; one update."""
    modes = list(LinearGradients)
    stages = [StageModule(_model(), _sgd, stage=0, input_grad=False, linear=m) for m in modes]
    torch.manual_seed(2)
    xs = [torch.randn(5, 4) for _ in range(3)]
    for st in stages:
        for u, x in enumerate(xs):
            st.forward(u, x)
            st.backward(u, torch.ones(5, 3))
        st.step()
    autograd = stages[modes.index(LinearGradients.AUTOGRAD)].module
    assert "forward" not in vars(autograd[0])
    for mode, st in zip(modes, stages, strict=True):
        assert ("forward" in vars(st.module[0])) is (mode is not LinearGradients.AUTOGRAD)
        for (name, a), b in zip(st.module.named_parameters(), autograd.parameters(),
                                strict=True):
            torch.testing.assert_close(a, b, msg=f"{mode} {name}")
    assert not torch.equal(autograd[0].weight, _model()[0].weight), "the step changed the weights"


class _Calls(TorchDispatchMode):
    """The ATen operators run inside the block (the backward's included), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.names.append(str(func.__name__).split(".")[0])
        return func(*args, **(kwargs or {}))


def _kernels(mode: LinearGradients) -> dict[str, int]:
    """The GEMMs, adds and sums of a stage's second backward of one update."""
    st = StageModule(_model(), _sgd, stage=0, input_grad=False, linear=mode)
    torch.manual_seed(4)
    for u in range(2):
        st.forward(u, torch.randn(5, 4))
        calls = _Calls()
        with calls:
            st.backward(u, torch.ones(5, 3))
    return {k: calls.names.count(k) for k in ("mm", "addmm_", "add_", "sum")}


def test_plain_linear_gradients_run_autograds_kernels_and_fused_ones_fewer() -> None:
    """PLAIN: each weight gradient a GEMM of its own and an ``add_`` into the sum, as
    autograd's AccumulateGrad does; FUSED: one ``addmm_`` into the sum instead."""
    autograd = _kernels(LinearGradients.AUTOGRAD)
    assert autograd == {"mm": 3, "addmm_": 0, "add_": 3, "sum": 1}
    assert _kernels(LinearGradients.PLAIN) == autograd
    assert _kernels(LinearGradients.FUSED) == {"mm": 1, "addmm_": 2, "add_": 1, "sum": 1}


@pytest.mark.parametrize("mode", [LinearGradients.FUSED, LinearGradients.PLAIN])
def test_a_held_backward_returns_the_input_gradient_before_the_weight_gemms(
    mode: LinearGradients,
) -> None:
    """``hold=True``: the weight GEMMs wait for :meth:`run_held` (or the next backward
    or step), then the gradients and the update equal the plain order bit for bit."""
    stages = [StageModule(_model(), _sgd, stage=1, input_grad=True, linear=mode)
              for _ in range(2)]
    torch.manual_seed(3)
    xs = [torch.randn(5, 4) for _ in range(3)]
    ins = []
    for hold, st in zip((False, True), stages, strict=True):
        grads_in = []
        for u, x in enumerate(xs):
            st.forward(u, x.clone())
            grads_in.append(st.backward(u, torch.ones(5, 3), hold=hold))
            if hold and u == 0:
                assert st._grads[0] is None and st._grads[2] is None, "weight GEMMs ran early"
                st.run_held()
                assert all(st._grads[i] is not None for i in range(3)), "run_held left a GEMM"
        ins.append(grads_in)
        st.step()
    for a, b in zip(*ins, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(stages[0].module.parameters(), stages[1].module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_linear_output_of_a_3d_input_may_be_written_in_place() -> None:
    """A transformer's feed-forward, ``Linear`` then ``ReLU(inplace=True)`` on ``[B, T, D]``:
    the fused layer's output is no view made inside its Function, so the in-place ReLU
    runs, and every way of making the gradients makes autograd's update."""
    def ffn() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 4))

    modes = list(LinearGradients)
    stages = [StageModule(ffn(), _sgd, stage=1, input_grad=True, linear=m) for m in modes]
    torch.manual_seed(2)
    x, g = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    grads = []
    for st in stages:
        st.forward(0, x.clone())
        grads.append(st.backward(0, g))
        st.step()
    want = stages[modes.index(LinearGradients.AUTOGRAD)]
    for mode, st, grad in zip(modes, stages, grads, strict=True):
        torch.testing.assert_close(grad, grads[modes.index(LinearGradients.AUTOGRAD)],
                                   msg=str(mode))
        for a, b in zip(st.module.parameters(), want.module.parameters(), strict=True):
            torch.testing.assert_close(a, b, msg=str(mode))


@pytest.mark.parametrize("shape", [(6, 4), (2, 3, 4)], ids=["2d", "3d"])
def test_an_in_place_write_of_a_fused_output_is_no_copy_around_a_view(
        shape: tuple[int, ...]) -> None:
    """The fused layer's output is a tensor of its own, not a view of one: an in-place
    ReLU after it then is a ReLU's backward, as in one process, not autograd's
    ``CopySlices`` around a view, whose backward holds activation-sized copies that no
    memory prediction counts."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True))
    names = [n for n, _ in model.named_parameters()]
    assert fuse_linear_gradients(model, names, GradientSum(list(model.parameters()),
                                                            fused=True)) == 1
    x = torch.randn(*shape, requires_grad=True)
    out = model[0](x)
    assert out._base is None and out.shape == (*shape[:-1], 8)
    want = nn.functional.linear(x, model[0].weight, model[0].bias)
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # F.linear's kernel, bit for bit
    assert type(model[1](out).grad_fn).__name__ == "ReluBackward0"

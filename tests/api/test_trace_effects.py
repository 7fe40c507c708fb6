"""What a traced forward does to the model is undone (``splitter/trace_effects.py``): a
buffer rebound in the forward is refused by name with the fix, a plain value it changes
is warned of, and the user's model is left as it was either way."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from dreampipe.errors import PlanError
from dreampipe.splitter.chain import Chain, split_layers

__all__: list[str] = []


class _Net(nn.Module):
    def __init__(self, update: Callable[[_Net], None]) -> None:
        super().__init__()
        self.update = update
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.steps = 0
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(6, 4)

    def forward(self, x: Tensor) -> Tensor:
        self.update(self)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * (1 + self.calls)


def _iadd(m: _Net) -> None:
    m.calls += 1


def _rebind(m: _Net) -> None:
    m.calls = m.calls + 1


def test_a_buffer_rebound_in_the_forward_is_refused_and_left_as_it_was() -> None:
    model = _Net(_rebind)
    calls = model.calls
    with pytest.raises(PlanError, match=r"assigns self\.calls.*self\.calls\.add_\(1\)"):
        split_layers(model, torch.randn(4, 6))
    assert model.calls is calls and int(calls) == 0  # the model still runs as PyTorch's
    model(torch.randn(4, 6))
    assert int(model.calls) == 1


@pytest.mark.parametrize("update", [lambda m: m.calls.add_(1), _iadd], ids=["add_", "+="])
def test_a_buffer_updated_in_place_traces_and_counts_each_call(
        update: Callable[[_Net], None]) -> None:
    model = _Net(update)
    chain = Chain(split_layers(model, torch.randn(4, 6)))
    assert int(model.calls) == 0  # the trace ran on meta values
    x = torch.randn(4, 6)
    chain(x)
    chain(x)
    assert int(chain.get_buffer("calls")) == 2


def test_a_plain_value_the_forward_changes_is_warned_of_and_restored(
        caplog: pytest.LogCaptureFixture) -> None:
    def count(m: _Net) -> None:
        m.steps += 1

    model = _Net(count)
    with caplog.at_level(logging.WARNING):
        split_layers(model, torch.randn(4, 6))
    said = [r.getMessage() for r in caplog.records if "self.steps" in r.getMessage()]
    assert len(said) == 1 and "plain Python value" in said[0] and "register_buffer" in said[0]
    assert model.steps == 0


class _Bias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.b


class _WritesItsInput(nn.Module):
    """``a`` crosses a cut and the next stage writes it in place before a later one reads
    it: valid in one process, where ``a`` is not a leaf of autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.b1, self.b2 = nn.Linear(4, 4), _Bias(), _Bias()
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        a = self.stem(x) * 1.0
        h = self.b1(a)
        a.mul_(2.0)
        h = self.b2(h)
        h += a
        return self.head(h.relu_())


def test_a_stage_writing_a_received_value_in_place_runs_as_one_process() -> None:
    torch.manual_seed(0)
    model, x = _WritesItsInput(), torch.randn(3, 4)
    want = model(x)
    want.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    layers = split_layers(model, x)
    names = [n for n, _ in layers]
    cuts = [0, names.index("b1"), names.index("b2"), len(layers)]
    received, sent = [], []
    value = x
    for s in range(3):  # each stage receives a leaf of autograd, as the runtime unpacks it
        if s > 0:
            value = value.detach().requires_grad_()
            received.append(value)
        value = Chain(layers[cuts[s]:cuts[s + 1]])(value)
        sent.append(value)
    assert torch.allclose(value, want)
    value.square().sum().backward()
    for s in (1, 0):
        sent[s].backward(received[s].grad)
    for name, grad in grads.items():
        got = dict(model.named_parameters())[name].grad
        assert got is not None and torch.allclose(got, grad), name

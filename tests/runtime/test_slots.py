"""A module run with a weight version in its parameters' places (:mod:`dreampipe.runtime.slots`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from dreampipe.runtime.slots import ParameterSlots

__all__: list[str] = []


class _Tied(nn.Module):
    """Two Linear layers sharing one weight, and a frozen scale."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.scale = nn.Parameter(torch.tensor(2.0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale


def _version(module: nn.Module) -> tuple[list[nn.Parameter], dict[str, torch.Tensor]]:
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    tensors = {n: (p.detach() + 0.5).requires_grad_(True) for n, p in named}
    return [p for _, p in named], tensors


def test_a_call_uses_the_version_everywhere_a_weight_is_tied_as_functional_call_does() -> None:
    torch.manual_seed(0)
    net = _Tied()
    params, tensors = _version(net)
    x = torch.randn(3, 4)
    got = ParameterSlots(net, params).call(list(tensors.values()), (x,))
    want = functional_call(net, tensors, (x,))
    assert torch.equal(got, want)
    assert not torch.equal(got, net(x))  # the version, not the live weights
    got.sum().backward()
    assert all(t.grad is not None for t in tensors.values())
    assert all(p.grad is None for p in params)  # gradients go to the version's tensors
    back = list(net.parameters())  # the parameters are back in their places
    assert len(back) == 4 and {id(p) for p in back} == {id(p) for p in [*params, net.scale]}


def test_the_parameters_are_back_when_the_forward_raises() -> None:
    net = _Tied()
    params, tensors = _version(net)
    slots = ParameterSlots(net, params)
    with pytest.raises(RuntimeError):
        slots.call(list(tensors.values()), (torch.randn(3, 5),))  # wrong width
    assert net.a.weight is params[0] and net.b.weight is params[0] and net.b.bias is params[2]

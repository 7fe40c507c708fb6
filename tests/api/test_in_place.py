"""In-place writes in a traced forward (``splitter/in_place.py``): ``+=`` writes in place
as in one process, a view that crosses a cut beside the tensor it views still sees a
later stage's write to it, a stage writing a received value runs on a copy of it, and
aliases no view op joins are refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from dreampipe.errors import PlanError
from dreampipe.splitter.chain import Chain, split_layers

__all__: list[str] = []


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, h: Tensor) -> Tensor:
        return h + torch.tanh(self.fc(h))


class _AddInPlace(nn.Module):
    """``first`` views ``h`` before ``h += 1``: one process's ``first`` sees the write."""

    def __init__(self) -> None:
        super().__init__()
        self.b0, self.b1, self.head = _Block(), _Block(), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.b0(x)
        first = h[:, 0]
        h += 1.0
        return self.head(self.b1(h)) + first.unsqueeze(-1)


class _ViewBeforeCut(nn.Module):
    """``cls`` views ``s`` on the first stage; a later stage writes ``s`` in place."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.b0, self.b1, self.head = nn.Linear(6, 6), _Block(), _Block(), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        s = self.inp(x)
        cls = s[:, 0].unsqueeze(-1)
        h = self.b1(self.b0(x))
        s += 1.0
        return self.head(h + cls + s)


class _ReluSkip(nn.Module):
    """A skip value ``s`` crosses the cut, and the next stage's glue writes it with an in-place
    function (no ``_`` method, no operator), which the trace knows by its meta values."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.b0, self.b1, self.head = nn.Linear(6, 6), _Block(), _Block(), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        s = self.inp(x)
        h = self.b1(self.b0(x))
        s = torch.nn.functional.relu(s, inplace=True)
        return self.head(h + s)


class _ChunksBeforeCut(nn.Module):
    """``a`` and ``b`` are views of one tensor that no view op joins; ``a`` is written."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.b0, self.head = nn.Linear(6, 12), _Block(), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.inp(x).chunk(2, dim=-1)
        h = self.b0(x)
        a.mul_(2.0)
        return self.head(h + a + b)


def _received(value: Any) -> Any:
    """``value`` as a stage receives it: each tensor its own leaf of autograd."""
    return pytree.tree_map_only(
        Tensor, lambda t: t.detach().clone().requires_grad_(t.is_floating_point()), value)


def _staged(model: nn.Module, x: Tensor, first: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
    """``model``'s output and weight gradients with its segments run as stages beginning at
    ``first``, each receiving its inputs as separate leaves and sending gradients back."""
    layers = split_layers(model, x)
    names = [n for n, _ in layers]
    cuts = [0, *(names.index(n) for n in first), len(layers)]
    value: Any = x
    sent, received = [], []
    for s in range(len(cuts) - 1):
        if s > 0:
            value = _received(value)
            received.append(value)
        value = Chain(layers[cuts[s]:cuts[s + 1]])(value)
        sent.append(value)
    value.square().sum().backward()
    for s in reversed(range(len(sent) - 1)):
        pairs = [(o, i.grad) for o, i in zip(pytree.tree_leaves(sent[s]),
                                             pytree.tree_leaves(received[s]), strict=True)
                 if isinstance(o, Tensor) and o.requires_grad and i.grad is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                            if p.grad is not None}


def _one_process(model: nn.Module, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    out = model(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out.detach(), grads


@pytest.mark.parametrize(("build", "first"), [(_AddInPlace, ["b1"]), (_AddInPlace, []),
                                              (_ViewBeforeCut, ["b0"]),
                                              (_ViewBeforeCut, ["b0", "b1"]),
                                              (_ReluSkip, ["b1"])])
def test_a_view_sees_a_write_in_place_as_in_one_process(build: type[nn.Module],
                                                        first: list[str]) -> None:
    torch.manual_seed(0)
    model, x = build(), torch.randn(4, 6)
    want, grads = _one_process(model, x)
    got, got_grads = _staged(model, x, first)
    assert torch.allclose(got, want, atol=1e-6)
    assert got_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(got_grads[name], grad, atol=1e-6), name


def test_a_view_rebuilt_after_the_cut_is_not_sent() -> None:
    layers = split_layers(_ViewBeforeCut(), torch.randn(4, 6))
    first = dict(layers)["inp"]
    outputs = next(n for n in first.graph.nodes if n.op == "output").args[0]
    assert [n.name for n in outputs] == ["x", "inp"]  # not cls: b0's stage rebuilds it


def test_aliases_no_view_op_joins_are_refused_by_name() -> None:
    with pytest.raises(PlanError, match=r"'getitem', 'getitem_1'.*cross the cut before "
                                        r"'b0' as views of one tensor.*'mul_'.*\.clone\(\)"):
        split_layers(_ChunksBeforeCut(), torch.randn(4, 6))

"""A forward that reads ``self.training`` between its blocks evaluates in eval mode: the
segments' graphs traced again with the model in eval mode (``splitter/eval_graphs.py``),
against the model itself; and where eval mode calls the blocks otherwise, ``evaluate()``
refuses before anything runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dreampipe
from dreampipe.splitter.chain import Chain, split_layers
from dreampipe.splitter.segments import eval_refusal

__all__: list[str] = []


class _Net(nn.Module):
    """Blocks with code between them that reads ``self.training`` as ``kind`` says."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.stem = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        if self.kind == "branch" and self.training:
            h = h * 0.5
        elif self.kind == "dropout":
            h = F.dropout(h, 0.5, self.training)
        elif self.kind == "order" and self.training:
            h = self.blocks[1](h)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _net(kind: str) -> _Net:
    torch.manual_seed(0)
    return _Net(kind)


@pytest.mark.parametrize("kind", ["plain", "branch", "dropout"])
def test_the_segments_run_as_the_model_in_either_mode(kind: str) -> None:
    model, x = _net(kind), torch.randn(5, 6)
    layers = split_layers(model, x)
    assert eval_refusal(layers) is None
    chain = Chain(layers)
    for mode in (False, True):
        chain.train(mode)
        model.train(mode)
        torch.manual_seed(1)
        got = chain(x)
        torch.manual_seed(1)
        torch.testing.assert_close(got, model(x), rtol=0, atol=0)
    # the mode changes the result where the forward reads it: the test can fail
    assert kind == "plain" or not torch.equal(chain.eval()(x), chain.train()(x))


def test_tracing_leaves_every_modules_own_mode_as_it_was() -> None:
    model = _net("branch")
    model.blocks[0].eval()  # a module the user keeps in eval mode
    split_layers(model, torch.randn(5, 6))
    assert [m.training for m in model.modules()] == [
        m is not model.blocks[0] and all(m is not c for c in model.blocks[0].modules())
        for m in model.modules()]


def test_eval_mode_that_calls_the_blocks_otherwise_is_refused_by_name() -> None:
    layers = split_layers(_net("order"), torch.randn(5, 6))
    assert "_Net's forward reads self.training" in (eval_refusal(layers) or "")


def _pipe(kind: str, data: list[tuple[Tensor, Tensor]]) -> dreampipe.Pipeline:
    return dreampipe.Pipeline(_net(kind), example=data[0], loss_fn=F.cross_entropy,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                              config=dreampipe.TrainConfig(schedule="1f1b-flush"))


def test_evaluate_runs_the_forwards_eval_branch() -> None:
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen))]
    pipe = _pipe("branch", data)
    try:
        got = pipe.evaluate(data)
    finally:
        pipe.close()
    model = _net("branch").eval()
    with torch.no_grad():
        want = float(F.cross_entropy(model(data[0][0]), data[0][1]))
        trained_branch = float(F.cross_entropy(model.train()(data[0][0]), data[0][1]))
    assert got.loss == pytest.approx(want, rel=1e-6)
    assert got.loss != pytest.approx(trained_branch, rel=1e-6)


def test_evaluate_refuses_what_it_cannot_run_in_eval_mode() -> None:
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen))]
    pipe = _pipe("order", data)
    try:
        pipe.step(*data[0])  # training runs it
        with pytest.raises(dreampipe.ConfigError, match="move that branch into the forward"):
            pipe.evaluate(data)
    finally:
        pipe.close()


def test_a_step_refuses_a_model_switched_after_its_trace() -> None:
    """The code between the blocks keeps the mode it was traced in while the blocks
    follow a switch: a step after ``model.train()`` on a model traced in eval mode would
    train with the dropout between the blocks off, so it is refused by name; switched
    back, the step runs as one process in eval mode."""
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen))]
    model = _net("dropout").eval()
    pipe = dreampipe.Pipeline(model, example=data[0], loss_fn=F.cross_entropy,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                              config=dreampipe.TrainConfig(schedule="1f1b-flush"))
    try:
        model.train()
        with pytest.raises(dreampipe.ConfigError, match=r"_Net was in eval mode when "
                           r"Pipeline\(...\) traced .* call model.train\(\) before"):
            pipe.step(*data[0])
        model.eval()
        model.stem.train()  # a block follows its own mode: nothing to refuse
        pipe.step(*data[0])
        losses = pipe.finish()
    finally:
        pipe.close()
    want = _net("dropout").eval()
    with torch.no_grad():
        assert losses == [pytest.approx(float(F.cross_entropy(want(data[0][0]), data[0][1])),
                                        rel=1e-6)]

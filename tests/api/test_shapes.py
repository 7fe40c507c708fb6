"""A model traced with its example's shapes baked in runs inputs of other shapes right,
keeping the graphs of a bounded number of them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

import dreampipe
from dreampipe.errors import PlanError
from dreampipe.splitter.chain import Chain, split_layers
from dreampipe.splitter.shape_graphs import ShapeGraphs, signature

from .model_zoo import gpt2

__all__: list[str] = []


def _text(batch: int, length: int, seed: int = 0) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, : length // 2] = 0  # left padding: the mask shapes the attention
    return {"input_ids": torch.randint(0, 11, (batch, length), generator=gen),
            "attention_mask": mask}


def _loss(out: Any, y: Tensor) -> Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def test_gpt2_with_a_mask_runs_other_lengths_and_batches_as_hugging_face_does() -> None:
    torch.manual_seed(0)
    model = gpt2().eval()
    layers = split_layers(model, _text(4, 6))
    assert layers[0][1].shapes is not None  # traced with the example's shapes baked in
    first, rest = Chain(layers[:4]), Chain(layers[4:])
    for batch, length in [(4, 6), (4, 5), (2, 3), (8, 6), (4, 5)]:
        x = _text(batch, length, seed=length)
        y = (x["input_ids"] + 1) % 11
        got = rest(first(x))
        want = model(**x)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(_loss(got, y), _loss(want, y), rtol=1e-6, atol=1e-6)
        hf = model(**x, labels=x["input_ids"]).loss
        got_hf = F.cross_entropy(got.logits[:, :-1].flatten(0, 1),
                                 x["input_ids"][:, 1:].flatten())
        torch.testing.assert_close(got_hf, hf, rtol=1e-6, atol=1e-6)


def test_a_pipeline_evaluates_batches_of_other_lengths_as_hugging_face_does() -> None:
    torch.manual_seed(0)
    model = gpt2()
    reference = gpt2()
    reference.load_state_dict(model.state_dict())
    reference.eval()
    example = _text(4, 6)
    pipe = dreampipe.Pipeline(model, example=(example, example["input_ids"]), loss_fn=_loss,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                              config=dreampipe.TrainConfig(schedule="1f1b-flush"))
    held_out = [(x, (x["input_ids"] + 1) % 11) for x in (_text(4, 5, 1), _text(2, 3, 2))]
    with torch.no_grad():
        want = [float(_loss(reference(**x), y)) * len(y) for x, y in held_out]
    got = pipe.evaluate(held_out).loss
    pipe.close()
    assert got == pytest.approx(sum(want) / sum(len(y) for _, y in held_out), rel=1e-6)


class _ByLength(nn.Module):
    """Calls one block for short inputs, another for long ones."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.short = nn.Linear(4, 4)
        self.long = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        return self.head(self.long(h) if x.shape[1] > 4 else self.short(h))


def test_inputs_that_take_another_branch_of_the_model_are_refused_naming_the_shapes() -> None:
    model = _ByLength()
    layers = split_layers(model, torch.randn(2, 6, 3))
    assert [n for n, _ in layers] == ["embed", "long", "head"]
    chain = Chain(layers)
    assert chain(torch.randn(5, 7, 3)).shape == (5, 7, 2)
    with pytest.raises(PlanError, match=r"branches on its inputs' shapes: for inputs float32 "
                                        r"\[2, 3, 3\] \(the example's: float32 \[2, 6, 3\]\) "
                                        r"it calls \['embed', 'short', 'head'\]"):
        chain(torch.randn(2, 3, 3))


def test_the_graphs_of_at_most_the_bound_of_signatures_are_kept_the_last_used_last() -> None:
    graphs = ShapeGraphs(lambda _: [("a", fx.Graph())], signature([torch.zeros(1)]),
                         [("a", fx.Graph())], kept=2)
    a, b, c = (signature([torch.zeros(n)]) for n in (2, 3, 4))
    assert graphs.graph(0, None) is graphs.graph(0, graphs.traced)  # the example's, never traced
    for sig in (a, b, a):
        graphs.graph(0, sig)
    assert (graphs.traces, graphs.signatures) == (2, [b, a])
    graphs.graph(0, c)  # b, the least recently used, goes
    assert (graphs.traces, graphs.signatures) == (3, [a, c])
    graphs.graph(0, b)
    assert (graphs.traces, graphs.signatures) == (4, [c, b])



def test_segments_fixed_to_a_signature_run_alone_on_its_shapes() -> None:
    """As a profile of another length calls them: one after the other, outside a chain."""
    torch.manual_seed(0)
    model = gpt2(positions=16).eval()
    layers = split_layers(model, _text(4, 6))
    first = layers[0][1]
    x = _text(4, 16)
    sig = first.signature(first.bind((x,)))
    assert sig is not None and sig != first.shapes.traced
    fixed = nn.Sequential(*(segment.at(sig) for _, segment in layers))
    with torch.no_grad():
        torch.testing.assert_close(fixed(x).logits, model(**x).logits, rtol=1e-6, atol=1e-6)
    assert all(segment.shapes is not None for _, segment in layers)  # the originals stay

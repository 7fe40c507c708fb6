"""Minibatches that change in the dimensions ``variable_dims`` declares, and only there; the
largest met is what the memory prediction profiles; a short minibatch's microbatches
count by their samples."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dreampipe
from dreampipe.api.batch_shapes import BatchShapes, check_batch
from dreampipe.errors import DatasetError

from .model_zoo import gpt2

__all__: list[str] = []


def _text(batch: int, length: int) -> tuple[dict[str, Tensor], Tensor]:
    ids = torch.arange(batch * length).view(batch, length) % 7
    return {"input_ids": ids, "mask": torch.ones(batch, length)}, ids


EXAMPLE = _text(4, 6)


@pytest.mark.parametrize(("batch", "shown"), [
    (_text(4, 9), "input_ids=torch.int64 [4, 9], mask=torch.float32 [4, 9]"),  # nothing declared
    (({"input_ids": EXAMPLE[0]["input_ids"]}, EXAMPLE[1]), "input_ids=torch.int64 [4, 6]"),
    (({"mask": EXAMPLE[0]["mask"], "input_ids": EXAMPLE[0]["input_ids"]}, EXAMPLE[1]),
     "mask=torch.float32 [4, 6], input_ids=torch.int64 [4, 6]"),
    (({**EXAMPLE[0], "mask": EXAMPLE[0]["mask"].long()}, EXAMPLE[1]),
     "input_ids=torch.int64 [4, 6], mask=torch.int64 [4, 6]"),
    (({**EXAMPLE[0], "mask": EXAMPLE[0]["mask"][..., None]}, EXAMPLE[1]),
     "input_ids=torch.int64 [4, 6], mask=torch.float32 [4, 6, 1]"),
])
def test_a_batch_unlike_the_example_but_in_declared_dims_is_refused_as_before(
        batch: tuple[Any, Tensor], shown: str) -> None:
    longer = batch[0]["input_ids"].shape[1] == 9
    declared = () if longer else (1,)
    message = (f"minibatch 3's input is {shown} but example's is input_ids=torch.int64 [4, 6], "
               "mask=torch.float32 [4, 6]; give every step a minibatch shaped like example (a "
               "DataLoader with drop_last=True drops a short last batch)")
    if longer:  # only a size differs: the error names the dimension to declare
        message += ("; or, where dimension 1 may change from step to step (a sequence's "
                    "length, a batch's samples), declare it: TrainConfig(variable_dims=(1,))")
    with pytest.raises(DatasetError, match=f"^{re.escape(message)}$"):
        check_batch(3, batch, EXAMPLE, declared)


@pytest.mark.parametrize(("batch", "declared", "named", "fix"), [
    (_text(3, 6), (), "dimension 0", "(0,)"),
    (_text(3, 9), (1,), "dimension 0", "(0, 1)"),
    (_text(3, 9), (), "dimension 0, 1", "(0, 1)"),
    ((EXAMPLE[0], EXAMPLE[1][:, :2]), (), "dimension 1", "(1,)"),
])
def test_a_batch_unlike_the_example_only_in_sizes_names_the_dims_to_declare(
        batch: tuple[Any, Tensor], declared: tuple[int, ...], named: str, fix: str) -> None:
    with pytest.raises(DatasetError, match=re.escape(
            f"; or, where {named} may change from step to step (a sequence's length, a "
            f"batch's samples), declare it: TrainConfig(variable_dims={fix})") + "$"):
        check_batch(3, batch, EXAMPLE, declared)
    check_batch(3, batch, EXAMPLE, tuple(int(d) for d in fix.strip("(,)").split(", ")))


def test_declared_dims_may_change_and_samples_only_with_dim_0() -> None:
    for length in (1, 6, 50):
        check_batch(1, _text(4, length), EXAMPLE, (1,))
    with pytest.raises(DatasetError, match=r"target is torch.int64 \[3, 6\] but example's is "
                                           r"torch.int64 \[4, 6\]"):
        check_batch(1, (EXAMPLE[0], EXAMPLE[1][:3]), EXAMPLE, (1,))
    with pytest.raises(DatasetError, match=r"input is input_ids=torch.int64 \[3, 6\]"):
        check_batch(1, _text(3, 6), EXAMPLE, (1,))
    check_batch(1, _text(3, 6), EXAMPLE, (0, 1), microbatches=2)
    check_batch(1, _text(9, 2), EXAMPLE, (0, 1), microbatches=2)
    with pytest.raises(DatasetError, match=r"minibatch 1's tensors hold \[3, 4\] samples "
                                           r"\(dimension 0\); give every input and the target"):
        check_batch(1, (EXAMPLE[0], torch.zeros(3, 6, dtype=torch.long)), EXAMPLE, (0, 1))
    with pytest.raises(DatasetError, match=r"minibatch 2 has 1 samples, fewer than its 2 "
                                           r"microbatches; give it 2 at least"):
        check_batch(2, _text(1, 6), EXAMPLE, (0,), microbatches=2)


def test_the_largest_batch_met_has_the_longest_samples_and_the_most_of_them() -> None:
    shapes = BatchShapes(EXAMPLE, (0, 1), microbatches=2)
    assert shapes.largest() == (EXAMPLE, 2)
    long = _text(3, 20)
    shapes.check(1, long)
    shapes.check(2, _text(4, 8))
    (x, y), size = shapes.largest()  # 3 samples of 20 tokens, for microbatches of 2
    assert (size, x["input_ids"].shape, y.shape) == (2, (3, 20), (3, 20))
    long[0]["input_ids"].fill_(0)  # a copy was kept: the caller may reuse its tensors
    assert int(x["input_ids"].sum()) > 0
    shapes.check(3, _text(10, 2))  # more samples, shorter: microbatches of 5 of 20 tokens
    (x, y), size = shapes.largest()
    assert (size, x["input_ids"].shape, y.shape) == (5, (6, 20), (6, 20))
    assert torch.equal(x["mask"][3:], x["mask"][:3])  # the longest samples, repeated


def test_a_short_minibatch_updates_as_its_mean_loss_does() -> None:
    """Microbatches of 3 and 2 samples: each counts its share, as one process on all 5."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    reference = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    pipe = dreampipe.Pipeline(model, example=(x, y), loss_fn=F.cross_entropy,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
                              config=dreampipe.TrainConfig(schedule="1f1b-flush", microbatches=2,
                                                           variable_dims=(0,)))
    pipe.step(x, y)
    pipe.step(x[:5], y[:5])
    losses = pipe.finish()
    state = pipe.full_state_dict()
    pipe.close()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    want = []
    for n in (8, 5):
        optimizer.zero_grad()
        loss = F.cross_entropy(reference(x[:n]), y[:n])
        loss.backward()
        optimizer.step()
        want.append(float(loss.detach()))
    assert losses == pytest.approx(want, rel=1e-6)
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-6, atol=1e-7)


def test_the_memory_prediction_profiles_the_longest_sequence_met() -> None:
    """GPT-2 with a mask, traced with the example's 8 tokens baked in, predicts after 64
    tokens what it predicts for an example of 64."""
    torch.manual_seed(0)

    def text(length: int) -> tuple[dict[str, Tensor], Tensor]:
        ids = torch.randint(0, 11, (4, length))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids

    def loss_fn(out: Any, y: Tensor) -> Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    def predicted(example: tuple[dict[str, Tensor], Tensor], *then: int) -> list[int]:
        pipe = dreampipe.Pipeline(gpt2(64), example=example, loss_fn=loss_fn,
                                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                  config=dreampipe.TrainConfig(schedule="1f1b-flush",
                                                               variable_dims=(1,),
                                                               measure_memory=True))
        pipe.step(*example)
        out = [pipe.memory().predicted]
        for length in then:
            pipe.step(*text(length))
        out.append(pipe.memory().predicted)
        pipe.close()
        return out

    short, long = predicted(text(8), 64, 16)
    assert long > 2 * short  # activations 8 times longer, attention 64 times larger
    assert long == predicted(text(64))[0]


def test_an_input_that_is_no_tensor_is_named() -> None:
    """A step that passes None (or a number) where the example had a tensor is refused by
    its position or name, not as an attribute error of None."""
    example = ((torch.zeros(4, 3), torch.ones(4, dtype=torch.bool)), torch.zeros(4))
    with pytest.raises(DatasetError, match=r"minibatch 2's input 1 is NoneType None, not a "
                                           r"tensor"):
        check_batch(2, ((torch.zeros(4, 3), None), torch.zeros(4)), example)  # type: ignore[arg-type]
    with pytest.raises(DatasetError, match=r"minibatch 0's input 'mask' is float 0.5"):
        check_batch(0, ({"x": torch.zeros(4, 3), "mask": 0.5}, torch.zeros(4)),  # type: ignore[dict-item]
                    ({"x": torch.zeros(4, 3), "mask": torch.ones(4)}, torch.zeros(4)))


def test_a_held_out_batch_needs_the_example_s_inputs_at_any_size() -> None:
    """evaluate() runs the graph traced from the example: another set of inputs is named on
    every rank before anything is sent (the trace's own message blamed the model's
    signature), while other sizes pass."""
    from dreampipe.api.batch_shapes import check_held_out

    example = ({"input_ids": torch.zeros(4, 8, dtype=torch.long)}, torch.zeros(4, 8))
    check_held_out(0, ({"input_ids": torch.zeros(3, 5, dtype=torch.long)}, torch.zeros(3, 5)),
                   example)
    masked = {"input_ids": torch.zeros(4, 8, dtype=torch.long),
              "attention_mask": torch.ones(4, 8, dtype=torch.long)}
    with pytest.raises(DatasetError, match=r"held-out batch 1's input is input_ids=.*, "
                                           r"attention_mask=.* but the example's is input_ids"):
        check_held_out(1, (masked, torch.zeros(4, 8)), example)
    with pytest.raises(DatasetError, match=r"held-out batch 0's target is torch.int64"):
        check_held_out(0, (example[0], torch.zeros(4, 8, dtype=torch.long)), example)

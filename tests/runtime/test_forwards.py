"""What an evaluation's forwards score: the class each output picks, the labels counted."""

from __future__ import annotations

import torch

from dreampipe.runtime.forwards import _score

__all__: list[str] = []


def test_scores_classes_on_axis_1_and_nothing_where_the_axis_is_unknown() -> None:
    y = torch.tensor([[0, 2, 1, 3], [1, 1, 0, 2]])
    classes_last = torch.nn.functional.one_hot(y, 5).float()  # [B, T, C]: T=4, C=5
    loss = torch.tensor(0.5)
    got = _score(classes_last.transpose(1, 2), y, loss, None)  # [B, C, T]
    assert (got.correct, got.labels) == (8, 8)
    got = _score(classes_last, y, loss, None)  # a loss may shift such labels: no score
    assert (got.correct, got.labels) == (0, 0)
    square = torch.nn.functional.one_hot(y, 4).float()  # [B, T, C] with T == C
    got = _score(square, y, loss, None)
    assert (got.correct, got.labels) == (0, 0)  # no accuracy, rather than one over positions
    plain = _score(torch.eye(3), torch.tensor([0, 2, 2]), loss, None)  # [B, C]
    assert (plain.correct, plain.labels) == (2, 3)


def test_ignored_targets_are_neither_right_nor_wrong() -> None:
    y = torch.tensor([0, 2, -100, -100])
    out = torch.nn.functional.one_hot(torch.tensor([0, 1, 2, 2]), 3).float()
    got = _score(out, y, torch.tensor(1.0), lambda t: t != -100)
    assert (got.correct, got.labels, got.samples, got.loss_sum) == (1, 2, 2.0, 2.0)

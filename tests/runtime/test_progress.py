"""The run's progress bar (:mod:`dreampipe.runtime.progress`)."""

from __future__ import annotations

import pytest
import torch

from dreampipe.runtime.progress import ProgressBar
from dreampipe.scheduling.actions import Action

__all__: list[str] = []


def test_the_bar_counts_backwards_and_shows_the_latest_loss(
    capsys: pytest.CaptureFixture[str],
) -> None:
    actions = tuple(Action.parse(t, 0) for t in ("F0", "F1", "B0", "STEP0", "B1", "STEP1"))
    bar = ProgressBar(actions, unit_size=8, pipedream=True)
    bar.update(torch.tensor(2.5))
    bar.update(torch.tensor(1.25))
    bar.close()
    shown = capsys.readouterr().err
    assert "2/2" in shown  # two backwards in the list, both done
    assert "loss=1.2500" in shown and "minibatch" in shown

"""The same run under torchrun: run_from_env reads torchrun's environment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrun import torchrun_json

from dreampipe.models import get_model
from dreampipe.runtime.data import load_dataset

from .reference import reference_sync, sgd

__all__: list[str] = []


@pytest.mark.timeout(120)
def test_run_from_env_under_torchrun() -> None:
    losses = torchrun_json(Path(__file__).with_name("torchrun_main.py"))["losses"]
    spec = get_model("mlp", layers=4, width=16)
    data = load_dataset("synthetic", spec, seed=3)
    expected, _ = reference_sync(spec, data, steps=3, minibatch=16, seed=3, opt=sgd(0.2))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=4e-5)

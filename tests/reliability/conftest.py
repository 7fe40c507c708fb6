"""The reliability tests' saved profiles: their runs start without profiling first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dreampipe.jobs.local import profile_as_worker
from dreampipe.models import get_model


@pytest.fixture(scope="session")
def mlp_profile(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """:func:`~.jobs.train_argv`'s mlp profiled as a worker computes ``batch`` samples, once
    per batch (``train --profile``): what these tests check is what a run loses or
    keeps, not its prediction, and each ``train`` would otherwise spend seconds
    profiling beside busy twins first."""
    folder = tmp_path_factory.mktemp("mlp-profile")

    def at(batch: int) -> Path:
        path = folder / f"mlp-{batch}.json"
        if not path.is_file():
            profile_as_worker(get_model("mlp", layers=4, width=32), batch, repeats=2).save(path)
        return path

    return at

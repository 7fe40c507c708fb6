"""Shared fixtures: where PipeDream's own profiles live, and a saved mlp profile."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from shared_profiles import PROFILES

from dreampipe.machine.local_plan import profile_as_worker
from dreampipe.models import get_model


@pytest.fixture(scope="session")
def pipedream_profiles() -> Path:
    """``<clone>/../shared/profiles/pipedream`` (as in CI), else the workspace copy."""
    return PROFILES


@pytest.fixture(scope="session")
def mlp_profile(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """The 4-layer mlp of width 32 profiled as a worker computes ``batch`` samples, once
    per batch, for ``train --profile``: tests that check what a run loses or keeps,
    not its prediction, start without the seconds ``train`` spends profiling beside
    busy twins first."""
    folder = tmp_path_factory.mktemp("mlp-profile")

    def at(batch: int) -> Path:
        path = folder / f"mlp-{batch}.json"
        if not path.is_file():
            profile_as_worker(get_model("mlp", layers=4, width=32), batch, repeats=2).save(path)
        return path

    return at

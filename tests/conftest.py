"""Shared fixtures: the folder of the bundled PipeDream profiles, and a saved mlp profile."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib.resources import as_file
from pathlib import Path

import pytest

from dreampipe.machine.local_plan import profile_as_worker
from dreampipe.models import get_model
from dreampipe.profiling.bundled import bundled_profile


@pytest.fixture(scope="session")
def pipedream_profiles() -> Iterator[Path]:
    """The bundled PipeDream profiles' folder on disk, for tests that hand a file path on
    (``pipedream:NAME`` names them where a path is not the point)."""
    with as_file(bundled_profile("pipedream:vgg16").resource) as vgg16:
        yield vgg16.parent


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

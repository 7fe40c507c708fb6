"""Shared fixtures: the folder of the bundled PipeDream profiles, a saved mlp profile, and
the machine file every test plans with."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from importlib.resources import as_file
from pathlib import Path

import pytest
from machine.fixtures import DEV_FILE, here_file

from dreampipe.machine.machine_file import ENV_VAR
from dreampipe.models import get_model
from dreampipe.profiling.bundled import bundled_profile
from dreampipe.runplan.worker_profile import profile_as_worker


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that hold a slow test first, each file whole and in its own order.

    ``make test`` hands whole files to two pytest-xdist processes in this order
    (``--dist loadfile``), so the long runs start first and the many short files fill
    the gaps at the end, instead of a long file starting last and running alone. A
    timing test's file must say ``mark.timing``: ``make test`` runs the timings from the
    files that do."""
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in heavy)
    timed = {item.path for item in items if item.get_closest_marker("timing")}
    hidden = sorted(str(path) for path in timed if "mark.timing" not in path.read_text())
    if hidden:  # make test's timings run collects the files that say so, and no other
        raise pytest.UsageError(f"{hidden}: mark a timing test with pytest.mark.timing in "
                                "its own file (the Makefile finds them so)")


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


@pytest.fixture(scope="session", autouse=True)
def machine_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every test (and every process it starts) plans with the project's development VM's
    machine file, made here: the same figures wherever the suite runs, none measured at
    start-up, and never the user's own file. A test of the file itself sets its own."""
    path = here_file(DEV_FILE, tmp_path_factory.mktemp("machine") / "machine.json")
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = str(path)
    yield path
    if before is None:
        del os.environ[ENV_VAR]
    else:
        os.environ[ENV_VAR] = before

"""The reliability tests' saved profile: their runs start without profiling first."""

from __future__ import annotations

from pathlib import Path

import pytest

from dreampipe.models import get_model
from dreampipe.profiling.profiler import profile_spec


@pytest.fixture(scope="session")
def mlp_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`~.jobs.train_argv`'s mlp profiled once (``train --profile``): what these tests
    check is what a run loses or keeps, not its prediction, and each ``train`` would
    otherwise spend seconds profiling beside busy twins first."""
    path = tmp_path_factory.mktemp("mlp-profile") / "mlp.json"
    profile_spec(get_model("mlp", layers=4, width=32), batch_size=16, repeats=2).save(path)
    return path

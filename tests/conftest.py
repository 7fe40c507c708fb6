"""Shared fixtures: where PipeDream's own profiles live."""

from __future__ import annotations

from pathlib import Path

import pytest
from shared_profiles import PROFILES


@pytest.fixture(scope="session")
def pipedream_profiles() -> Path:
    """``<clone>/../shared/profiles/pipedream`` (as in CI), else the workspace copy."""
    return PROFILES

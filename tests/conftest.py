"""Shared fixtures: where PipeDream's own profiles live."""

from __future__ import annotations

from pathlib import Path

import pytest

_BESIDE_CLONE = Path(__file__).resolve().parents[2] / "shared/profiles/pipedream"
_FALLBACK = Path("/work/shared/profiles/pipedream")


@pytest.fixture(scope="session")
def pipedream_profiles() -> Path:
    """``<clone>/../shared/profiles/pipedream`` (as in CI), else the workspace copy."""
    for candidate in (_BESIDE_CLONE, _FALLBACK):
        if (candidate / "vgg16.txt").is_file():
            return candidate
    raise FileNotFoundError(
        f"PipeDream profiles not found at {_BESIDE_CLONE} or {_FALLBACK}; "
        "put the shared/ folder beside the clone"
    )

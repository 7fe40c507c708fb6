"""Where PipeDream's own profiles live: ``<clone>/../shared`` as in CI, else the workspace copy."""

from __future__ import annotations

from pathlib import Path

__all__ = ["PROFILES"]

_CANDIDATES = (
    Path(__file__).resolve().parents[2] / "shared/profiles/pipedream",
    Path("/work/shared/profiles/pipedream"),
)


def _find() -> Path:
    for candidate in _CANDIDATES:
        if (candidate / "vgg16.txt").is_file():
            return candidate
    raise FileNotFoundError(
        f"PipeDream profiles not found in {[str(c) for c in _CANDIDATES]}; "
        "put the shared/ folder beside the clone"
    )


PROFILES = _find()

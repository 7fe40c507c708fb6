"""Placeholder: the `train` sub-command module is being written."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def register(sub: "argparse._SubParsersAction[Any]") -> None:
    """Add nothing yet."""

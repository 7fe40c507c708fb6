"""A ``dreampipe train`` run written as one set of fields, as the runtime's tests write them."""

from __future__ import annotations

import dataclasses
from typing import Any

from dreampipe.api import TrainConfig
from dreampipe.commands.train_config import TrainRun

__all__ = ["train_run"]

_CONFIG = frozenset(f.name for f in dataclasses.fields(TrainConfig))


def train_run(**fields: Any) -> TrainRun:
    """The run of ``fields``: the TrainConfig fields its config, the others its own."""
    config = TrainConfig(**{k: v for k, v in fields.items() if k in _CONFIG})
    return TrainRun(config=config, **{k: v for k, v in fields.items() if k not in _CONFIG})

"""In-process Pipelines start a process group of one; none outlives its test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_group_left() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()

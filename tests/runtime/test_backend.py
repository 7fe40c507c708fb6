"""The backend a node's ranks join with: NCCL only where every local rank has a GPU."""

from __future__ import annotations

import logging

import pytest
import torch

from dreampipe.api import group
from dreampipe.runtime.backend import Backend, backend_for_node


@pytest.mark.parametrize(("gpus", "ranks", "backend"), [
    (0, 1, Backend.GLOO), (0, 2, Backend.GLOO), (1, 1, Backend.NCCL), (1, 2, Backend.GLOO),
    (8, 8, Backend.NCCL), (8, 4, Backend.NCCL),
])
def test_nccl_needs_a_gpu_per_local_rank(monkeypatch: pytest.MonkeyPatch, caplog:
                                         pytest.LogCaptureFixture, gpus: int, ranks: int,
                                         backend: Backend) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert backend_for_node(ranks) is backend
    assert backend.threads == (None if backend is Backend.NCCL else 1)
    # joining a group: too few GPUs for the ranks is said, with the fix
    with caplog.at_level(logging.WARNING, logger="dreampipe.api.group"):
        assert group._backend(ranks) == backend.value
    warned = [r.getMessage() for r in caplog.records]
    if 0 < gpus < ranks:
        assert warned and f"at most {gpus} ranks a node" in warned[0]
    else:
        assert not warned

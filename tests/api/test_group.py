"""The backend a rank joins with: NCCL only where every local rank has a GPU of its own."""

from __future__ import annotations

import logging

import pytest
import torch

from dreampipe.api.group import backend_for_node


@pytest.mark.parametrize(("gpus", "ranks", "backend"), [
    (0, 1, "gloo"), (0, 2, "gloo"), (1, 1, "nccl"), (1, 2, "gloo"), (8, 8, "nccl"), (8, 4, "nccl"),
])
def test_nccl_needs_a_gpu_per_local_rank(monkeypatch: pytest.MonkeyPatch, caplog:
                                         pytest.LogCaptureFixture, gpus: int, ranks: int,
                                         backend: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with caplog.at_level(logging.WARNING, logger="dreampipe.api.group"):
        assert backend_for_node(ranks) == backend
    # too few GPUs for the ranks: the fall-back to the CPU is said, with the fix
    warned = [r.getMessage() for r in caplog.records]
    if 0 < gpus < ranks:
        assert warned and f"at most {gpus} ranks a node" in warned[0]
    else:
        assert not warned

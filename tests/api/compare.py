"""How a Pipeline run is compared with a single-process reference."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ATOL", "RTOL", "assert_matches"]

RTOL, ATOL = 1e-5, 4e-5


def assert_matches(got: dict[str, Any], losses: list[float], state: dict[str, torch.Tensor]
                   ) -> None:
    """The run's losses and final state equal the reference's, key by key."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses),
                               rtol=RTOL, atol=ATOL)
    assert sorted(got["state"]) == sorted(state)
    for name, value in state.items():
        torch.testing.assert_close(got["state"][name], value, rtol=RTOL, atol=ATOL, msg=name)

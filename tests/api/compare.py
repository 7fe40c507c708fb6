"""How a Pipeline run is compared with a single-process reference."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ATOL", "RTOL", "assert_matches"]

#: The float32 rounding a correct run may differ from one process by: where it adds
#: partial results in another order than the reference's one pass (replicas' gradients
#: in an all-reduce, a tensor-split stage's partial sums over more than 2 workers), a few
#: roundings per update, compounded over a test's few steps. Not the reductions a split
#: stage cuts into shards: summed whole, their rounding depends on the CPU's kernel set
#: (4.2e-5 on a 2048-wide mlp under AVX-512); references given ``split_as=plan`` cut them
#: as the run does (``tests/runtime/reference.py``).
RTOL, ATOL = 1e-5, 4e-5


def assert_matches(got: dict[str, Any], losses: list[float], state: dict[str, torch.Tensor]
                   ) -> None:
    """The run's losses and final state equal the reference's, key by key."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses),
                               rtol=RTOL, atol=ATOL)
    assert sorted(got["state"]) == sorted(state)
    for name, value in state.items():
        torch.testing.assert_close(got["state"][name], value, rtol=RTOL, atol=ATOL, msg=name)

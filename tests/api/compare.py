"""How a Pipeline run is compared with a single-process reference."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["ATOL", "RTOL", "TIMES", "assert_matches", "assert_within_rounding", "distance"]

#: The float32 rounding a correct run may differ from one process by: where it adds
#: partial results in another order than the reference's one pass (replicas' gradients
#: in an all-reduce, a tensor-split stage's partial sums over more than 2 workers), a few
#: roundings per update, compounded over a test's few steps. Not the reductions a split
#: stage cuts into shards: summed whole, their rounding depends on the CPU's kernel set
#: (4.2e-5 on a 2048-wide mlp under AVX-512); references given ``split_as=plan`` cut them
#: as the run does (``tests/runtime/reference.py``).
RTOL, ATOL = 1e-5, 4e-5

#: How many times one 16-bit process's distance from fp32 a 16-bit run may be from it.
TIMES = 3


def assert_matches(got: dict[str, Any], losses: list[float], state: dict[str, torch.Tensor]
                   ) -> None:
    """The run's losses and final state equal the reference's, key by key."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses),
                               rtol=RTOL, atol=ATOL)
    assert sorted(got["state"]) == sorted(state)
    for name, value in state.items():
        torch.testing.assert_close(got["state"][name], value, rtol=RTOL, atol=ATOL, msg=name)


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float((a[k].float() - b[k].float()).abs().max()) for k in b}


def assert_within_rounding(got: dict[str, Any], ref: tuple[list[float], dict[str, torch.Tensor]],
                           fp32: tuple[list[float], dict[str, torch.Tensor]],
                           start: dict[str, torch.Tensor]) -> None:
    """A 16-bit run's losses and final state are no further from one process in that
    precision (``ref``) than :data:`TIMES` times that process's distance from fp32 (an
    fp32 process that skips the same updates: ``fp32``), tensor by tensor and over the
    losses, with fp32's tolerance added: the rounding the pipeline meets in other places
    (16-bit stage boundaries, replicas summing 16-bit gradients). So that the bound can
    fail, each compared tensor must have moved from ``start`` by twice it: a weight that
    lost its gradient is caught."""
    (ref_losses, ref_state), (fp32_losses, fp32_state) = ref, fp32
    rounding = distance(ref_state, fp32_state)
    off = distance(got["state"], ref_state)
    moved = distance(ref_state, start)
    assert sorted(got["state"]) == sorted(ref_state)
    for k, bound in rounding.items():
        if not ref_state[k].is_floating_point() or moved[k] == 0.0:
            continue  # a buffer, or a weight no update reaches (both checked equal below)
        tolerance = TIMES * bound + ATOL + RTOL * float(ref_state[k].abs().max())
        assert moved[k] > 2 * tolerance, (k, moved[k], tolerance)  # the bound can fail
        assert off[k] <= tolerance, (
            f"{k}: {off[k]:.3g} from the 16-bit process, which is {bound:.3g} from fp32")
    for k in rounding:
        if moved[k] == 0.0:
            assert off[k] == 0.0, k
    loss_bound = max(abs(a - b) for a, b in zip(ref_losses, fp32_losses, strict=True))
    for a, b in zip(got["losses"], ref_losses, strict=True):
        assert math.isclose(a, b, abs_tol=TIMES * loss_bound + ATOL), (got["losses"],
                                                                       ref_losses)

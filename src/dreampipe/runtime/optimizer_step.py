"""What an optimizer's step allocates beside its state, measured on the optimizer itself.

A step's temporaries can set a stage's peak when its weights outweigh its activations:
PyTorch's single-tensor Adam makes two tensors the size of the parameter it is on
(``exp_avg_sq.sqrt() / ...``) while the last one's denominator lives on, its ``foreach``
form (the default on CUDA) one the size of every parameter of a group at once, its
``fused`` form none, plain SGD none. Rather than a table per optimizer and form,
:func:`measure_step_bytes` steps the user's own optimizer on three sets of small
parameters and solves for the bytes per byte of the largest parameter, of the second
largest and of all of them (docs/design.md §5.4).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dreampipe.profiling.tensor_bytes import TensorBytes

__all__ = ["NO_STEP_BYTES", "StepBytes", "measure_step_bytes", "stage_step_bytes"]

_log = logging.getLogger(__name__)

#: Elements of the probes' unit parameter: large beside a step's scalar temporaries.
_PROBE = 1 << 14


@dataclass(frozen=True)
class StepBytes:
    """A step's temporaries: ``largest`` bytes per byte of the largest parameter it steps,
    ``second`` per byte of the second largest and ``total`` per byte of all of them."""

    largest: float = 0.0
    second: float = 0.0
    total: float = 0.0

    def of(self, sizes: list[int]) -> float:
        """The temporaries of a step over parameters of ``sizes`` bytes."""
        top = [*sorted(sizes, reverse=True)[:2], 0, 0]
        return self.largest * top[0] + self.second * top[1] + self.total * sum(sizes)


#: No step temporaries: what a failed probe, or an optimizer without any, gives.
NO_STEP_BYTES = StepBytes()


def stage_step_bytes(step: StepBytes, parameter_bytes: list[int], *, master_weights: bool,
                     shards: int = 1) -> float:
    """The temporaries of a stage's step over parameters of ``parameter_bytes`` (as far as
    its profile knows them), ``1 / shards`` of each under ZeRO; where ``master_weights``,
    the optimizer's over the 32-bit masters (twice the 16-bit weights) and the 32-bit
    copies of the gradients it steps them with
    (:class:`~dreampipe.runtime.precision.MasterWeights`)."""
    scale = (2.0 if master_weights else 1.0) / shards
    masters = [round(b * scale) for b in parameter_bytes]
    return step.of(masters) + (sum(masters) if master_weights else 0)


def _temporaries(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 sizes: tuple[int, ...], device: torch.device) -> float:
    """The most bytes a second step of ``make``'s optimizer holds beyond its state (the
    first makes the state)."""
    params = [nn.Parameter(torch.zeros(n, device=device)) for n in sizes]
    optimizer = make(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        tracker = TensorBytes(device.type)
        try:
            with tracker.counting(), torch.no_grad():
                optimizer.step()
        finally:
            tracker.close()
    return float(tracker.peak)


def measure_step_bytes(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                       device: torch.device | None = None) -> StepBytes:
    """``make``'s step temporaries (module doc), on ``device`` (default the CPU), whose
    default form of an optimizer may differ; none if ``make`` cannot step the probes
    (an optimizer that wants named groups, say), which is logged."""
    device = torch.device("cpu") if device is None else device
    one = _PROBE * torch.zeros((), dtype=torch.float32).element_size()
    try:
        single, pair, triple = (_temporaries(make, (_PROBE,) * k, device) / one
                                for k in (1, 2, 3))
    except Exception as exc:  # a user's factory may want other arguments
        _log.info("the optimizer's step temporaries are not counted: stepping probes "
                  "failed (%s: %s)", type(exc).__name__, exc)
        return NO_STEP_BYTES
    # units of one probe: single = a + b, pair = a + c + 2 b, triple = a + c + 3 b
    total = max(0.0, triple - pair)
    largest = max(0.0, single - total)
    return StepBytes(largest=largest, second=max(0.0, pair - largest - 2 * total),
                     total=total)

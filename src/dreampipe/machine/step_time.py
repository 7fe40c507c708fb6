"""How many plain SGD steps' time the run's own optimizer takes to step.

A prediction prices a stage's update by a plain SGD step (read the weight and its
gradient, write the weight), timed with the caches emptied and beside the other ranks'
work (:mod:`.rates`' ``step_bandwidth``). Other optimizers take longer: momentum reads
and writes its buffer, and Adam runs a dozen elementwise kernels over its two moments.
:func:`step_factor` times the run's optimizer and plain SGD on the same probe
parameters on the ranks' device, the caches emptied before each step as the rates do,
and gives the ratio of their medians; the prediction prices a step at that many plain
ones, so the rates' own conditions (a busy neighbour, a cold cache) carry over
(docs/design.md §9.1).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch
from torch import nn

from dreampipe.machine.rates import EVICT_BYTES, timed_cold
from dreampipe.machine.timers import timer_for

__all__ = ["step_factor"]

_log = logging.getLogger(__name__)

#: The probe parameters: four of 4 MB, beyond a core's own caches as a stage's weights are.
_PROBES, _PROBE_ELEMENTS = 4, 1 << 20
#: Timed steps of each optimizer, after two untimed ones (the first makes its state).
_ROUNDS = 5

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def step_factor(make: Make, device: torch.device | None = None) -> float:
    """The time of a step of ``make``'s optimizer over a plain SGD step's on the same
    parameters (on ``device``, default the CPU), each from cold caches; 1 where ``make``
    cannot step the probes (an optimizer that wants named groups, say), which is logged."""
    device = torch.device("cpu") if device is None else device
    cold = torch.empty(EVICT_BYTES // 4, device=device)
    try:
        own = _step_s(make, device, cold)
    except Exception as exc:  # a user's factory may want other arguments
        _log.info("the optimizer's step is priced as a plain SGD step: stepping probes "
                  "failed (%s: %s)", type(exc).__name__, exc)
        return 1.0
    plain = _step_s(lambda params: torch.optim.SGD(params, lr=1e-6), device, cold)
    return own / plain if plain > 0 and own > 0 else 1.0


def _step_s(make: Make, device: torch.device, cold: torch.Tensor) -> float:
    """Median seconds of a step of ``make``'s optimizer over the probes, each after
    writing ``cold`` (:func:`~.rates.timed_cold`)."""
    params = [nn.Parameter(torch.zeros(_PROBE_ELEMENTS, device=device))
              for _ in range(_PROBES)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = make(params)
    with torch.no_grad():
        optimizer.step()  # makes its state; timed_cold steps once more untimed
        took = timed_cold(optimizer.step, _ROUNDS, 0.0, cold, timer_for(device))
    return statistics.median(took)

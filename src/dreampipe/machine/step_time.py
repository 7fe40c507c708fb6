"""How long the run's own optimizer steps, against the plain SGD step the machine is timed on.

A prediction prices a stage's update by the traffic of a plain SGD step
(read the weight and its gradient, write the weight; :mod:`.rates`'
``step_bandwidth``). Other optimizers move more: momentum reads and writes its
buffer, Adam its two moments and its temporaries, so their step takes a
multiple of that time (docs/design.md §9.1). :func:`step_factor` steps the
run's optimizer and plain SGD on the same probe parameters, on the ranks'
device, and gives the ratio of their medians.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch
from torch import nn

from dreampipe.machine.timers import timer_for

__all__ = ["step_factor"]

_log = logging.getLogger(__name__)

#: The probe parameters: four of 4 MB, beyond a core's caches as a stage's weights are.
_PROBES, _PROBE_ELEMENTS = 4, 1 << 20
#: Timed steps of each optimizer, after two untimed ones (the first makes its state).
_ROUNDS = 5


def step_factor(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                device: torch.device | None = None) -> float:
    """The time of a step of ``make``'s optimizer over the time of a plain SGD step on the
    same parameters (on ``device``, default the CPU): 1 for plain SGD, more for one that
    keeps state. 1 where ``make`` cannot step the probes (an optimizer that wants named
    groups, say), which is logged."""
    device = torch.device("cpu") if device is None else device
    try:
        own = _step_s(make, device)
    except Exception as exc:  # a user's factory may want other arguments
        _log.info("the optimizer's step is priced as a plain SGD step: stepping probes "
                  "failed (%s: %s)", type(exc).__name__, exc)
        return 1.0
    plain = _step_s(lambda params: torch.optim.SGD(params, lr=1e-6), device)
    return own / plain if plain > 0 and own > 0 else 1.0


def _step_s(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
            device: torch.device) -> float:
    """Median seconds of a step of ``make``'s optimizer over the probes."""
    params = [nn.Parameter(torch.zeros(_PROBE_ELEMENTS, device=device))
              for _ in range(_PROBES)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = make(params)
    timer = timer_for(device)
    with torch.no_grad():
        for _ in range(2):
            optimizer.step()
        return statistics.median(timer(optimizer.step) for _ in range(_ROUNDS))

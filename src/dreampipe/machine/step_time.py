"""How many plain SGD steps' time the run's own optimizer takes to step.

A prediction prices a stage's update by a plain SGD step (read the weight and its
gradient, write the weight), timed with the caches emptied and beside the other ranks'
work (:mod:`.rates`' ``step_bandwidth``). Other optimizers take longer: momentum reads
and writes its buffer, and Adam runs a dozen elementwise kernels over its two moments.
:func:`step_factor` times the run's optimizer and plain SGD on the same probe
parameters on the ranks' device, the caches emptied before each step as the rates do,
and gives the ratio of their medians; the prediction prices a step at that many plain
ones, so the rates' own conditions (a busy neighbour, a cold cache) carry over
(docs/design.md §9.1). :func:`prediction_factor` prices weight prediction (Adam's
staleness compensation) the same way: the work it adds to a delayed stage's update.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch
from torch import nn

from dreampipe.machine.rates import EVICT_BYTES
from dreampipe.machine.timers import timer_for
from dreampipe.runtime.versions import WeightVersions

__all__ = ["prediction_factor", "step_factor"]

_log = logging.getLogger(__name__)

#: The probe parameters: four of 4 MB, beyond a core's own caches as a stage's weights are.
_PROBES, _PROBE_ELEMENTS = 4, 1 << 20
#: Timed rounds, each timing the work and a plain SGD step in turn, after an untimed one
#: of each; the work's time and the plain step's each vary by tens of percent from round
#: to round on a shared host, so the ratio is of medians over rounds run side by side.
_ROUNDS = 15

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def step_factor(make: Make, device: torch.device | None = None) -> float:
    """The time of a step of ``make``'s optimizer over a plain SGD step's on the same
    parameters (on ``device``, default the CPU), each from cold caches; 1 where ``make``
    cannot step the probes (an optimizer that wants named groups, say), which is logged."""
    device = torch.device("cpu") if device is None else device
    params = _probes(device)
    try:
        optimizer = make(params)
        with torch.no_grad():
            optimizer.step()  # makes its state
    except Exception as exc:  # a user's factory may want other arguments
        _log.info("the optimizer's step is priced as a plain SGD step: stepping probes "
                  "failed (%s: %s)", type(exc).__name__, exc)
        return 1.0
    return _over_plain(optimizer.step, device) or 1.0


def prediction_factor(device: torch.device | None = None) -> float:
    """The work weight prediction adds to a delayed stage's update, in plain SGD steps
    over the same weights (on ``device``, default the CPU), each from cold caches.

    Per update such a stage keeps its weights before the step, takes their change after it
    and extrapolates one new version, which the update's microbatches run on (one under
    pipedream, all of a minibatch's under 2bw: :mod:`dreampipe.runtime.versions`). The
    probe runs those very calls on the probes, so it prices what the runtime does."""
    device = torch.device("cpu") if device is None else device
    versions = WeightVersions(_probes(device), stage=0, on_leaf=lambda _i, _t: None,
                              on_drop=lambda _v: None, predict=True)

    def update() -> None:  # the runtime's order: FORWARD (and its BACKWARD), STEP
        version = versions.acquire(versions.version, update=versions.version + 1)
        versions.release(version)
        versions.retire()
        versions.advance()

    with torch.no_grad():
        update()  # the first update has no change to extrapolate by yet
    return _over_plain(update, device)


def _probes(device: torch.device) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(_PROBE_ELEMENTS, device=device)) for _ in range(_PROBES)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    return params


def _over_plain(work: Callable[[], object], device: torch.device) -> float:
    """The median time of ``work`` over a plain SGD step's on the probes, in rounds that
    time each in turn, each after writing :data:`~.rates.EVICT_BYTES` as the rates do;
    0 where the plain step took no measurable time."""
    cold = torch.empty(EVICT_BYTES // 4, device=device)
    plain = torch.optim.SGD(_probes(device), lr=1e-6)
    timer = timer_for(device)
    own: list[float] = []
    base: list[float] = []
    with torch.no_grad():
        plain.step()
        for k in range(_ROUNDS):
            for took, step in ((own, work), (base, plain.step)):
                cold.fill_(k)
                took.append(timer(step))
    mid = statistics.median(base)
    return statistics.median(own) / mid if mid > 0 else 0.0

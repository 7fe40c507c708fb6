"""Predicted and measured steady-state throughput of workers joined by a known link.

:mod:`dreampipe.runplan.prediction` predicts for this machine's local workers, on
loopback at the bandwidth measured on this machine (:mod:`~dreampipe.machine.measure`).
Workers on a real (or shaped) network differ in one figure, the link's
bandwidth: :func:`on_link` is the same calibration at another bandwidth and
:func:`simulate_on` the simulator's run of a plan there.

Both a measured run (the runtime's recorded events) and a simulated one are
read the same way by :func:`window_rates`, so that predicted and measured
throughput cover the same window: start-up and drain left out, the steady
state cut into equal windows of whole all-reduce rounds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dreampipe.errors import ConfigError
from dreampipe.machine.calibration import LocalCalibration, local_costs
from dreampipe.planning.plan import Plan
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import parse_bandwidth
from dreampipe.scheduling.actions import ActionKind, ScheduleKind
from dreampipe.scheduling.events import Event
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout

if TYPE_CHECKING:
    from dreampipe.simulation.simulator import SimResult

__all__ = ["on_link", "round_microbatches", "simulate_on", "window_rates"]


def on_link(bandwidth: str, machine: LocalCalibration) -> LocalCalibration:
    """``machine``'s calibration with its workers joined at ``bandwidth`` (``"50MB/s"``).

    The host-side figures (send overhead, per-stage time) stay: they are the
    workers' own, whatever joins them. Which of cores and wire sets an
    all-reduce's pace decides the rest:

    - a link at least as fast as ``machine.bandwidth`` (what gloo's copies
      and sums on the computing cores reach, measured on loopback) changes
      nothing: the cores stay the bottleneck, busy, so nothing overlaps;
    - a slower link sets the rate, and while the bytes wait on the wire the
      cores compute: the runtime's bucketed all-reduce, started during the
      backward, overlaps it (``overlap``): the wait after the backward is the
      transfer less the backward, not the whole transfer.
    """
    if parse_bandwidth(bandwidth) >= parse_bandwidth(machine.bandwidth):
        return machine
    return dataclasses.replace(machine, bandwidth=bandwidth, overlap=True)


def simulate_on(
    graph: LayerGraph,
    plan: Plan,
    kind: ScheduleKind,
    *,
    minibatch_size: int,
    steps: int,
    machine: LocalCalibration,
    microbatches: int = 1,
) -> SimResult:
    """The simulator's run of ``steps`` updates of ``plan`` on ``machine``'s workers.

    What :func:`~dreampipe.runplan.prediction.predict_samples_per_s` simulates, on a
    given calibration (:func:`on_link`), with its events for
    :func:`window_rates`. ``graph`` must be profiled at the layout's microbatch size.
    """
    from dreampipe.simulation.simulator import simulate_schedule

    layout = MicrobatchLayout(kind=kind, minibatch_size=minibatch_size, microbatches=microbatches,
                              workers=plan.workers_used)
    schedule = layout.build([st.replicas for st in plan.stages], steps, plan.in_flight)
    fraction = layout.microbatch_size / graph.batch_size if graph.batch_size else 1.0
    return simulate_schedule(schedule, local_costs(graph, plan, fraction, machine))


def round_microbatches(plan: Plan) -> int:
    """Microbatches in one all-reduce round of the input stage (1 when it is not replicated)."""
    return plan.stages[0].replicas


def window_rates(
    events: Sequence[Event], *, microbatch_size: int, skip_microbatches: int,
    window_microbatches: int
) -> list[float]:
    """Samples/s in each window of ``window_microbatches`` finished microbatches after
    ``skip_microbatches``.

    A microbatch is finished when its backward at the input stage (stage 0) ends:
    the last thing a pipeline does with it, and for a replicated input stage
    the end of its round's compute. Windows run from the ``skip_microbatches``-th
    finish to the ``skip_microbatches + window_microbatches``-th, then on, as many whole
    windows as the events hold. Make both counts multiples of
    :func:`round_microbatches` so that each window holds whole all-reduce rounds.
    """
    if skip_microbatches < 1 or window_microbatches < 1:
        raise ConfigError(
            f"skip_microbatches={skip_microbatches}, window_microbatches={window_microbatches}: "
            "skip at least the first "
            "microbatch (the window starts at a finish) and make windows of 1 microbatch or more",
            "skip_microbatches", "window_microbatches",
        )
    ends = sorted(e.end_s for e in events if e.kind is ActionKind.BACKWARD and e.stage == 0)
    rates = []
    start = skip_microbatches - 1
    while start + window_microbatches < len(ends):
        span = ends[start + window_microbatches] - ends[start]
        rates.append(window_microbatches * microbatch_size / span if span > 0 else math.inf)
        start += window_microbatches
    if not rates:
        raise ConfigError(
            f"{len(ends)} finished microbatches hold no window of {window_microbatches} after "
            "the first "
            f"{skip_microbatches}; run more steps", "skip_microbatches", "window_microbatches",
        )
    return rates

"""How many minibatches each stage of a PipeDream pipeline holds in flight.

A replica of stage ``s`` runs that many forwards before its first backward
(1F1B's warm-up) and stashes that many weight versions, so the count sets
both throughput and memory. PipeDream's rule (NOAM, docs/design.md §5) gives each
worker from the stage to the end one minibatch, shared among the stage's
replicas: ``ceil(W_s / r_s)``. It keeps a pipeline full when every unit
moves on as soon as it is done.

Replicated stages break that assumption. The ``r`` replicas of a stage
get their round's units, or the gradients of them, one period ``T`` apart
from a neighbour stage, and all join the round's all-reduce, so the first
waits up to ``(r-1) T`` there, before its next forward and its next
backward: up to ``2 (r-1) T`` more round trip for every unit in flight
through the stage. By Little's law a stage keeps its rate only with that
many more units in flight::

    in_flight(s) = ceil((W_s + join * E_s) / r_s),
    E_s = sum of (r_i - 1) over stages i >= s      (0 for the last stage)

``join = 2`` covers the worst case (the default); ``join = 0`` is
PipeDream's rule. The last stage runs each unit's backward right after its
forward, so more in flight there only delays it (data parallelism, one
stage, keeps one). ``E_s`` never grows downstream, so every ``join`` gives a
schedule without deadlock (its validator checks). PipeDream's profiles with
the planner's plans, simulated (``tests/simulation/test_pipedream_profiles.py``):
GNMT on cluster A, config 1-1-2-1-1-2-4-3-1, runs at 55% of the planner's
steady-state rate with ``join = 0`` and at 100-110% with ``join = 2``;
AlexNet 13-1-1 on cluster B at 91% and 100%. The price is memory: a stage
holds more weight versions and stashed activations (its memory
prediction counts them), and a plan made under a memory limit keeps the
deepest buffer that fits (:data:`JOIN_BUFFERS`).

A stage split over ``t`` workers is one schedule rank per replica but runs
on ``t`` workers; the planner's search counts every worker after a stage
(``W_s = r_s + sum of r_i t_i over later stages``), a bound that equals the
rule above when no split stage follows and holds at least as many otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

from dreampipe.errors import PlanError

__all__ = ["JOIN_BUFFERS", "in_flight_counts", "versions_in_flight"]

#: The join buffers a planner tries, deepest first: a plan with a memory limit
#: keeps the deepest whose stages all fit (0, PipeDream's rule, is what the
#: planner's search checks, so one always fits).
JOIN_BUFFERS = (2, 1, 0)


def versions_in_flight(workers_to_end: int, replicas: int) -> int:
    """PipeDream's count: ``ceil(F / r)``, ``n - s`` at stage ``s`` of a straight pipeline."""
    return -(-workers_to_end // replicas)


def in_flight_counts(replicas: Sequence[int], join: int = JOIN_BUFFERS[0],
                     widths: Sequence[int] = ()) -> tuple[int, ...]:
    """Minibatches per replica of each stage in flight (module doc), ``join`` as given;
    ``widths[s]`` the workers of each replica of stage ``s`` (empty: 1 each)."""
    if join < 0:
        raise PlanError(f"join={join}; use 0 (PipeDream's rule) or more")
    t = list(widths) or [1] * len(replicas)
    out = []
    for s, r in enumerate(replicas):
        extra = sum(m - 1 for m in replicas[s:]) if s < len(replicas) - 1 else 0
        after = sum(m * w for m, w in zip(replicas[s + 1:], t[s + 1:], strict=True))
        out.append(versions_in_flight(r + after + join * extra, r))
    return tuple(out)

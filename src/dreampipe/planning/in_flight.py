"""How many minibatches each stage of a PipeDream pipeline holds in flight.

A replica of stage ``s`` runs that many forwards before its first backward
(1F1B's warm-up) and stashes that many weight versions, so the count sets
both throughput and memory. PipeDream's rule gives each worker from the stage
to the end one minibatch, shared by the stage's replicas; dreampipe adds a
join buffer for the waits of replicated stages at their all-reduce::

    in_flight(s) = ceil((W_s + join * E_s) / r_s),
    E_s = sum of (r_i - 1) over stages i >= s      (0 for the last stage)

``join = 0`` is PipeDream's rule, ``join = 2`` the default; a plan under a
memory limit keeps the deepest buffer of :data:`JOIN_BUFFERS` that fits.
The reasoning, and the count before split stages: docs/design.md §5.2, §10.3.
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

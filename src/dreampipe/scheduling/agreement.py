"""Which schedules can hold every rank's update to one agreement.

Clipping by the global norm (``max_grad_norm``), an fp16 loss scale, skipping a
non-finite minibatch and vertical sync make the ranks agree on each update
before its first step; a weight tied across stages sums its copies' gradients
in each update of those stages. Under pipedream a stage's version counts its own
updates, so stages replicated unequally update at different rates and have no
common update to agree on: the run would wait forever. docs/design.md §9.
"""

from __future__ import annotations

from collections.abc import Sequence

from dreampipe.errors import ConfigError
from dreampipe.scheduling.actions import ScheduleKind

__all__ = ["check_agreement"]


def check_agreement(kind: ScheduleKind, replicas: Sequence[int], what: str, *names: str) -> None:
    """A ConfigError where ``kind`` on stages of ``replicas`` cannot agree on each update
    (module doc); ``what`` is the setting that asks for it, ``names`` the knobs the error
    names."""
    if kind is ScheduleKind.PIPEDREAM and len(set(replicas)) > 1:
        raise ConfigError(
            f"{what} with pipedream needs every stage replicated equally (got "
            f"{'-'.join(map(str, replicas))}): a stage's version counts its own updates, so "
            "stages that update at different rates have no common update to share; use a plan "
            "with equal replica counts", *names,
        )

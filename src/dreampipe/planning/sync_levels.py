"""A stage's times at each ZeRO level, from what no level changes, made once for all levels.

The synchronous tables (:mod:`dreampipe.planning.sync_tables`) offer a stage each ZeRO
level as one more option, the twins of an option alike but for it. What the level does
not change (the forward, the backward, the all-reduce and its end) is made once for the
twins as :class:`LevelFree`, with the figures of a level that leaves them as they are;
:func:`at_level` applies one level's rule (:func:`~dreampipe.planning.zero_terms.
zero_times`, docs/design.md §5.6) and reads those figures wherever the rule left its
inputs unchanged, so each level costs only what it changes, the same values as pricing
it alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dreampipe.planning.costs import FloatArray
from dreampipe.planning.zero_terms import HALF_ALLREDUCE, zero_times

__all__ = ["LevelFree", "at_level"]


@dataclass(frozen=True)
class LevelFree:
    """What a table of stages costs at any ZeRO level: the inputs of
    :func:`~dreampipe.planning.zero_terms.zero_times` (``forward``, ``backward``, the
    weight gradient ``made``, ``allreduce``, ``delay``, ``gather``), where the compute is
    ``finite``, the all-reduce's end after the recomputed forward (``end_again``), and
    ``tau`` and the update's wait ``left`` of a level that changes none of them."""

    forward: FloatArray
    backward: FloatArray
    made: FloatArray
    allreduce: FloatArray
    delay: FloatArray
    gather: FloatArray
    finite: npt.NDArray[np.bool_]
    end_again: FloatArray
    tau: FloatArray
    left: FloatArray

    @classmethod
    def of(cls, forward: FloatArray, compute: FloatArray, again: FloatArray, end: FloatArray,
           allreduce: FloatArray, wgrad: FloatArray) -> LevelFree:
        """From the stages' forward, compute (forward and backward), the forward they run
        again, the all-reduce's end after the backward starts, the all-reduce, and the
        weight gradients' share of the backward."""
        body = compute - forward
        backward = body + again
        finite, end_again = np.isfinite(compute), end + again
        left = np.where(allreduce > 0, np.maximum(0.0, end_again - backward), 0.0)
        return cls(forward, backward, np.minimum(wgrad, body), allreduce,
                   end - allreduce + again, allreduce * HALF_ALLREDUCE, finite, end_again,
                   np.where(finite, forward + backward, np.inf), left)


def at_level(terms: LevelFree, level: int, replicas: int, splits_backward: bool
             ) -> tuple[FloatArray, FloatArray, FloatArray]:
    """``(tau, tail, weight gradient)`` of ``terms`` at ZeRO ``level`` over ``replicas``
    (``splits_backward``: a schedule that runs ``W`` apart; the weight gradient is what its
    ``W`` computes, before any wait for ZeRO's reduce-scatter, which fills no bubble)."""
    y = terms
    z = zero_times(level, replicas, forward=y.forward, backward=y.backward,
                   weight_grad=y.made, allreduce=y.allreduce, delay=y.delay, gather=y.gather,
                   splits_backward=splits_backward and level >= 2)
    same = z.forward is y.forward and z.backward is y.backward
    tau = y.tau if same else np.where(y.finite, z.forward + z.backward, np.inf)
    if same and z.allreduce is y.allreduce:
        left = y.left
    elif (z.allreduce > 0).any():
        left = np.where(z.allreduce > 0, np.maximum(0.0, y.end_again - z.backward), 0.0)
    else:  # nothing left to all-reduce
        left = np.zeros_like(y.left)
    return tau, left + z.step, y.made

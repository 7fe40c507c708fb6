"""What ZeRO's levels cost one stage in time, per microbatch and per update.

The rule (docs/design.md §5.6), for a stage on two replicas or more: at levels 1 and 2
its step ends with an all-gather of the updated weights (``gather``). At level 2 or more
it reduce-scatters each microbatch's gradient as its backward makes it: half an
all-reduce's bytes, starting ``delay`` into the backward (its first bucket), and the
backward waits for the last one, so the part that completes the gradient (the backward,
or its weight-gradient part where the schedule splits it) ends no earlier than the
reduce-scatter; the update's all-reduce then has nothing left to send. At level 3 per
use each forward and each backward also gathers the stage's weights (``gather`` each),
and the update's gather is gone. The simulator
(:func:`dreampipe.simulation.zero_costs.with_zero`) and the planner's synchronous
objective (:mod:`dreampipe.planning.sync_tables`) both price a stage with
:func:`zero_times`, element-wise over NumPy arrays of layer ranges or on single figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy loads when the times are priced: SHARDED_LEVEL stays light
    import numpy as np
    import numpy.typing as npt

__all__ = ["HALF_ALLREDUCE", "SHARDED_LEVEL", "ZeroTimes", "zero_times"]

#: The ZeRO level from which a stage's weights are sharded between uses.
SHARDED_LEVEL = 3
#: What a reduce-scatter or an all-gather of a stage's weights takes of its all-reduce
#: (a ring all-reduce is one of each).
HALF_ALLREDUCE = 0.5

if TYPE_CHECKING:
    FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class ZeroTimes:
    """A stage's seconds per microbatch (``forward``, ``backward``, its ``weight_grad``
    part, the update's ``allreduce`` and ``gather``) and what its ``step`` adds."""

    forward: FloatArray
    backward: FloatArray
    weight_grad: FloatArray
    allreduce: FloatArray
    gather: FloatArray
    step: FloatArray


def zero_times(level: int, replicas: int, *, forward: FloatArray | float,
               backward: FloatArray | float, weight_grad: FloatArray | float,
               allreduce: FloatArray | float, delay: FloatArray | float,
               gather: FloatArray | float, splits_backward: bool = False,
               per_use: bool = True) -> ZeroTimes:
    """The stage's times at ZeRO ``level`` over ``replicas`` (module doc); ``per_use``: a
    level-3 stage gathers per forward and backward (every replica runs as many
    microbatches an update), else once an update."""
    import numpy as np

    f, b, w = (np.asarray(x, dtype=np.float64) for x in (forward, backward, weight_grad))
    ar, g = np.asarray(allreduce, dtype=np.float64), np.asarray(gather, dtype=np.float64)
    step = np.zeros_like(ar)
    if level < 1 or replicas < 2:
        return ZeroTimes(f, b, w, ar, g, step)
    if level < SHARDED_LEVEL:
        step = step + g
    if level < 2:
        return ZeroTimes(f, b, w, ar, g, step)
    scatter = ar * HALF_ALLREDUCE
    if splits_backward:  # W completes the gradient; its reduce-scatter starts with it
        tail = np.maximum(0.0, scatter - w)
        w = w + tail
    else:
        tail = np.maximum(0.0, np.asarray(delay, dtype=np.float64) + scatter - b)
    b = b + tail
    ar = np.zeros_like(ar)
    if level >= SHARDED_LEVEL and per_use:
        f, b, g = f + g, b + g, np.zeros_like(g)
    return ZeroTimes(f, b, w, ar, g, step)

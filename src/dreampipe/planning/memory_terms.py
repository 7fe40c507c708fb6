"""What one worker holds for a stage, in bytes: the planner's memory terms.

One rule serves the planner (``dreampipe plan``'s memory column and ``--memory``),
the simulator and the runtime's memory report: weight versions, the gradient,
optimizer state, the inputs and kept tensors of the minibatches in flight (with the copy
of its input a stage runs on where its first layer writes it, :func:`input_copies`), the
stage's working set and the sends it keeps (docs/design.md §5.4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dreampipe.errors import ConfigError
from dreampipe.profiling.graph import LayerGraph

__all__ = ["SENDS_KEPT", "STATELESS", "OptimizerTerms", "blocks_kept_bytes", "input_copies",
           "max_versions", "memory_bytes", "stage_memory"]

FloatArray = npt.NDArray[np.float64]

#: Sent tensors a rank keeps: :mod:`dreampipe.runtime.comm` reaps its oldest
#: sends only once more than this many are posted, so their tensors stay alive.
SENDS_KEPT = 16


@dataclass(frozen=True)
class OptimizerTerms:
    """What the optimizer holds beside a stage's weights and their gradient, in bytes per
    byte of weights: its state (``state_copies``: SGD 0, with momentum 1, Adam 2) and a
    bound on its step's temporaries, ``per_largest`` per byte of the stage's largest layer
    and ``per_byte`` per byte of all its weights (docs/design.md §5.4). The planner counts
    the temporaries beside everything else the stage holds, which bounds a peak that holds
    them only while it steps."""

    state_copies: float = 0.0
    per_largest: float = 0.0
    per_byte: float = 0.0

    def __post_init__(self) -> None:
        for name in ("state_copies", "per_largest", "per_byte"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name}={value} must be 0 or more: the optimizer's bytes "
                                  "per byte of weights (Adam's state_copies 2, SGD's 0)", name)

    def step_bytes(self, largest: FloatArray | float, weights: FloatArray | float
                   ) -> FloatArray:
        """The bound on the step's temporaries of a stage whose largest layer holds
        ``largest`` bytes of weights and whose layers ``weights`` in all."""
        return np.asarray(self.per_largest * np.asarray(largest, dtype=np.float64)
                          + self.per_byte * np.asarray(weights, dtype=np.float64))

    @property
    def per_layer(self) -> float:
        """What it holds per byte of each layer, a sum over layers: its state and the
        temporaries of every byte (not those of the largest layer)."""
        return self.state_copies + self.per_byte


#: An optimizer that holds nothing beside the weights and their gradient: plain SGD.
STATELESS = OptimizerTerms()


def memory_bytes(
    weight_bytes: FloatArray | float,
    activation_bytes: FloatArray | float,
    versions: int,
    in_flight: int,
    *,
    input_bytes: FloatArray | float = 0.0,
    sent_bytes: FloatArray | float = 0.0,
    working_bytes: FloatArray | float = 0.0,
    optimizer_copies: float = 0.0,
    stash: bool = True,
    sends_kept: int = SENDS_KEPT,
    recompute: bool = False,
    step_bytes: FloatArray | float = 0.0,
) -> FloatArray:
    """Bytes per worker of a stage (docs/design.md §5.4)::

        stash      weights * (versions + 1 + optimizer) + (input + kept) * in_flight
                   + working + sends
        recompute  weights * (versions + 1 + optimizer) + input * in_flight + (input + kept)
                   + working + sends
        no stash   weights * (1 + 1 + optimizer) + input * in_flight + (input + kept)
                   + working + sends

    ``activation_bytes`` is what the stage's layers keep for the backward of
    one microbatch (:attr:`~dreampipe.profiling.graph.Layer.stash_bytes`), and the
    copy of its input its graph holds where it writes it (:func:`input_copies`),
    ``input_bytes`` the microbatch's input it received, ``sent_bytes`` the larger
    tensor it sends (activation or gradient), kept ``sends_kept`` times (a run
    of fewer sends keeps all of them); ``working_bytes`` what the stage holds
    besides: the largest layer's backward working set (its upstream gradient and the
    gradients it makes) and the compute library's kernel memory (:mod:`.held`).
    ``versions`` counts the live weights; the extra ``weights`` is the gradient
    buffer; ``optimizer_copies`` is the optimizer's state in weights (SGD 0,
    with momentum 1, Adam 2) and ``step_bytes`` its step's temporaries (a bound,
    :class:`OptimizerTerms`). Without stashing a microbatch in flight keeps its
    input only and the backward recomputes one microbatch's graph.
    """
    w = np.asarray(weight_bytes, dtype=np.float64)
    a = np.asarray(activation_bytes, dtype=np.float64)
    x = np.asarray(input_bytes, dtype=np.float64)
    fixed = _fixed(w, working_bytes, sent_bytes, optimizer_copies, sends_kept) + step_bytes
    if stash and not recompute:
        return np.asarray(fixed + versions * w + in_flight * (x + a))
    return np.asarray(fixed + (versions if stash else 1) * w + in_flight * x + x + a)


def _fixed(w: FloatArray, working_bytes: FloatArray | float, sent_bytes: FloatArray | float,
           optimizer_copies: float, sends_kept: int) -> FloatArray:
    """What a stage holds whatever its minibatches in flight: a gradient and the optimizer's
    state beside its weights, its working set and the sends it keeps."""
    return np.asarray((1 + optimizer_copies) * w + np.asarray(working_bytes, dtype=np.float64)
                      + sends_kept * np.asarray(sent_bytes, dtype=np.float64))


def input_copies(graph: LayerGraph) -> list[int]:
    """``[k]``: what a stage that begins at layer ``k`` keeps per microbatch beside its input
    and its layers' kept tensors: where layer ``k`` writes its input in place
    (:attr:`~dreampipe.profiling.graph.Layer.writes_input`), the copy of that input its
    forward runs on (:mod:`dreampipe.runtime.input_writes`), which its graph holds until
    the backward, as it holds the layers' kept tensors. The copy is of layer ``k``'s own
    inputs as they cross a cut (their :attr:`~dreampipe.profiling.graph.Layer.
    activation_bytes`, in the run's compute dtype): the whole cut on a chain. The first
    stage writes the data it is given, and one process the layer before's output, which
    the profile counts already: 0 at ``k = 0`` and where layer ``k`` writes nothing."""
    into: dict[int, set[int]] = {}
    for src, dst in graph.edges:
        into.setdefault(dst, set()).add(src)
    return [sum(graph.layers[i].activation_bytes for i in into.get(k, ()))
            if k > 0 and x.writes_input else 0 for k, x in enumerate(graph.layers)]


def blocks_kept_bytes(kept: Sequence[float], inputs: Sequence[float], recomputed: int,
                      in_flight: int) -> float:
    """Activation bytes a stage of blocks holds when it recomputes its first
    ``recomputed`` blocks (docs/design.md §4.6), with ``in_flight`` microbatches::

        (inputs[:k] + kept[k:]) * in_flight + max(kept[:k])

    ``kept[i]``: what block ``i`` keeps for one microbatch's backward when it does not
    recompute; ``inputs[i]``: its input, all a recomputed block keeps. One backward at a
    time holds a recomputed block's tensors again (the largest's, at worst).
    """
    n = len(kept)
    if len(inputs) != n or not 0 <= recomputed <= n or in_flight < 0:
        raise ConfigError(
            f"blocks={recomputed} of {n} blocks ({len(inputs)} inputs) with "
            f"in_flight={in_flight}: give one input per block, 0 <= blocks <= {n} and "
            "in_flight >= 0", "blocks")
    again = max(kept[:recomputed], default=0.0)
    return float((sum(inputs[:recomputed]) + sum(kept[recomputed:])) * in_flight + again)


def stage_memory(
    weight_bytes: FloatArray | float, activation_bytes: FloatArray | float, versions: int, *,
    input_bytes: FloatArray | float = 0.0, sent_bytes: FloatArray | float = 0.0,
    working_bytes: FloatArray | float = 0.0,
) -> FloatArray:
    """Bytes per worker in the planner's steady state: stashing, one version per minibatch
    in flight, an optimizer without state (:func:`memory_bytes` with ``in_flight = versions``)."""
    return memory_bytes(weight_bytes, activation_bytes, versions, versions,
                        input_bytes=input_bytes, sent_bytes=sent_bytes,
                        working_bytes=working_bytes)


def max_versions(
    weight_bytes: FloatArray | float, activation_bytes: FloatArray | float, memory_bytes: float,
    *, input_bytes: FloatArray | float = 0.0, sent_bytes: FloatArray | float = 0.0,
    working_bytes: FloatArray | float = 0.0, recompute: bool = False,
    optimizer_copies: float = 0.0, step_bytes: FloatArray | float = 0.0,
) -> FloatArray:
    """The most versions a stage can hold in ``memory_bytes`` (inverse of :func:`memory_bytes`
    stashing, or recomputing with ``recompute``, versions equal to the minibatches in flight),
    beside ``optimizer_copies`` of its weights for the optimizer's state and ``step_bytes``
    for its step.

    0 or less means the stage does not fit at all; a stage whose versions cost
    nothing can hold any number (``inf``) if the rest fits.
    """
    w = np.asarray(weight_bytes, dtype=np.float64)
    a = np.asarray(activation_bytes, dtype=np.float64)
    x = np.asarray(input_bytes, dtype=np.float64)
    fixed = _fixed(w, working_bytes, sent_bytes, optimizer_copies, SENDS_KEPT) + step_bytes
    per = w + x + (0.0 if recompute else a)
    if recompute:
        fixed = fixed + x + a
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.floor((memory_bytes - fixed) / per)
    return np.asarray(np.where(per > 0, k, np.where(fixed <= memory_bytes, np.inf, 0.0)))

"""What one replica of a stage keeps of its weights, gradients and optimizer state under
ZeRO level ``L`` over ``r`` replicas (:mod:`.zero`), for the memory model.

The rule (Rajbhandari et al. 2020, §5): level 1 keeps 1/r of the optimizer state, level 2
also 1/r of the gradients, level 3 also 1/r of the weights between uses (under ``bf16``
none of the 16-bit weights: the 32-bit master chunk is what a replica keeps, and its
gathers send its rounding; :mod:`.zero_params`). The optimizer state is the
optimizer's own 32-bit tensors (``optimizer_copies`` of them a parameter: 2 for Adam, 1 for
SGD with momentum, 0 for plain SGD) and, with ``master_weights`` (``precision="bf16"``),
the 32-bit master copies of the 16-bit weights, which the optimizer steps and so are
sharded with its state. A 32-bit stage with Adam on 2 replicas keeps 16 bytes a
parameter at level 0, 12 at level 1, 10 at level 2 and 8 at level 3. Padding (a
parameter's last chunk may be shorter) is left out. docs/design.md §5.6.
"""

from __future__ import annotations

from dataclasses import dataclass

from dreampipe.errors import ConfigError

__all__ = ["ZeroBytes", "zero_bytes"]


@dataclass(frozen=True)
class ZeroBytes:
    """Bytes one replica keeps (at level 3, between uses): ``weights`` (in their own dtype),
    ``gradients`` (the update's sums, in the weights' dtype) and ``optimizer`` (its state
    and any masters)."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def zero_bytes(level: int, replicas: int, param_bytes: float, *, optimizer_copies: int,
               master_weights: bool = False) -> ZeroBytes:
    """One replica's bytes for a stage whose parameters take ``param_bytes`` (in their dtype:
    4 a value in 32 bits, 2 under ``bf16``) at ZeRO ``level`` over ``replicas``.

    ``optimizer_copies``: 32-bit tensors of the optimizer's state per parameter (Adam 2);
    ``master_weights``: the weights are 16-bit and the optimizer steps 32-bit copies.
    """
    if not 0 <= level <= 3:
        raise ConfigError(f"zero={level}; give 0, 1, 2 or 3", "zero")
    if replicas < 1 or optimizer_copies < 0 or param_bytes < 0:
        raise ValueError(f"replicas={replicas}, optimizer_copies={optimizer_copies}, "
                         f"param_bytes={param_bytes}: give replicas >= 1 and the rest >= 0")
    fp32 = 2 * param_bytes if master_weights else param_bytes  # the values, 4 bytes each
    optimizer = (optimizer_copies + (1 if master_weights else 0)) * fp32
    weights = (param_bytes if level < 3 or replicas == 1
               else 0.0 if master_weights else param_bytes / replicas)  # the masters hold them
    return ZeroBytes(
        weights=weights,
        gradients=param_bytes / replicas if level >= 2 else param_bytes,
        optimizer=optimizer / replicas if level >= 1 else optimizer,
    )

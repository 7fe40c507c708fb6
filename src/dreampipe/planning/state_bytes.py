"""What one replica of a stage keeps of its weights, gradients and optimizer state: the
number formats and optimizer a run trains with (:class:`Training`), and ZeRO's shards.

The rule (Rajbhandari et al. 2020, §5): level 1 keeps 1/r of the optimizer state, level 2
also 1/r of the gradients, level 3 also 1/r of the weights between uses (under ``bf16``
none of the 16-bit weights: the 32-bit master chunk is what a replica keeps, and its
gathers send its rounding; :mod:`dreampipe.runtime.zero_params`). The optimizer state is
the optimizer's own 32-bit tensors (``optimizer_copies`` of them a parameter: 2 for Adam,
1 for SGD with momentum, 0 for plain SGD) and, with ``master_weights``
(``precision="bf16"``), the 32-bit master copies of the 16-bit weights, which the
optimizer steps and so are sharded with its state. A 32-bit stage with Adam on 2
replicas keeps 16 bytes a parameter at level 0, 12 at level 1, 10 at level 2 and 8 at
level 3; a ``bf16`` one 16 at level 0 (dreampipe's 16-bit gradients; Megatron-LM
accumulates 32-bit ones, 18). Padding is left out. The
runtime's memory prediction and the planner's synchronous objective read these terms;
docs/design.md §5.6.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dreampipe.errors import ConfigError
from dreampipe.profiling.gpt_spec import BY_SHAPE, parse_gpt_spec
from dreampipe.profiling.graph import LayerGraph

__all__ = ["OPTIMIZER_COPIES", "PRECISION_PARAM_BYTES", "Training", "ZeroBytes",
           "profiled_param_bytes", "zero_bytes"]

#: Bytes a weight (and its gradient) takes in each precision the runtime trains in
#: (:class:`dreampipe.runtime.precision.Precision`): 16 bits only under ``bf16``, whose
#: optimizer steps 32-bit masters; the mixed precisions keep 32-bit weights.
PRECISION_PARAM_BYTES = {"fp32": 4, "bf16-mixed": 4, "fp16-mixed": 4, "bf16": 2}
#: The optimizer's 32-bit state tensors a parameter (``--optimizer``): Adam's two moments.
OPTIMIZER_COPIES = {"sgd": 0, "adam": 2}


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


def zero_bytes(level: int, replicas: int, param_bytes: float, *, optimizer_copies: float,
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


@dataclass(frozen=True)
class Training:
    """The number formats and optimizer a plan is priced for (``--precision``,
    ``--optimizer``). ``precision`` None keeps the profile's own bytes a weight, with no
    masters; ``optimizer`` names the state it keeps (plain SGD: none)."""

    precision: str | None = None
    optimizer: str = "sgd"

    def __post_init__(self) -> None:
        if self.precision is not None and self.precision not in PRECISION_PARAM_BYTES:
            raise ConfigError(f"precision={self.precision!r}; give one of "
                              f"{', '.join(PRECISION_PARAM_BYTES)}", "precision")
        if self.optimizer not in OPTIMIZER_COPIES:
            raise ConfigError(f"optimizer={self.optimizer!r}; give one of "
                              f"{', '.join(OPTIMIZER_COPIES)}", "optimizer")

    def trained(self, graph: LayerGraph) -> LayerGraph:
        """``graph`` with each layer's weights in this precision's bytes (its activations
        as profiled). A profile by shape is timed at its device's 16-bit peak with
        Megatron-LM's 16-bit activations, so it does not price ``fp32``."""
        spec = graph.meta.get(BY_SHAPE)
        if spec and self.precision == "fp32":
            raise ConfigError(
                f"precision='fp32' with profile {spec}, whose layers run at the device's "
                "16-bit peak and keep 16-bit activations; give bf16, bf16-mixed or "
                "fp16-mixed (32-bit weights, 16-bit products), or profile the model itself",
                "precision")
        profiled = profiled_param_bytes(graph)
        scale = self.param_bytes(profiled) / profiled
        if scale == 1:
            return graph
        return replace(graph, layers=tuple(replace(
            x, parameter_bytes=round(x.parameter_bytes * scale),
            largest_parameter_bytes=None if x.largest_parameter_bytes is None
            else round(x.largest_parameter_bytes * scale)) for x in graph.layers))

    def param_bytes(self, profiled: float) -> float:
        """Bytes a weight takes as trained; ``profiled``: as the profile counts it."""
        return profiled if self.precision is None else PRECISION_PARAM_BYTES[self.precision]

    def state_per_byte(self, profiled: float, level: int = 0, replicas: int = 1) -> float:
        """What a replica keeps of weights, gradients and optimizer state per byte of
        weights as trained, at ZeRO ``level`` over ``replicas`` (:func:`zero_bytes`)."""
        size = self.param_bytes(profiled)
        kept = zero_bytes(level, replicas, size, optimizer_copies=OPTIMIZER_COPIES[
            self.optimizer], master_weights=self.precision is not None and size < 4)
        return kept.total / size


def profiled_param_bytes(graph: LayerGraph) -> int:
    """Bytes a weight takes in ``graph``: a profile by shape's ``param_bytes``, else 4
    (profiles are measured in 32 bits)."""
    spec = graph.meta.get(BY_SHAPE)
    return parse_gpt_spec(spec).param_bytes if spec else 4

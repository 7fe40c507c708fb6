"""Operator partitioning as data: how each kind of layer can be split over ``t`` workers.

After Tofu (Wang et al.), a layer runs under one :class:`Split` over all ``t``
workers of a group (``REPLICA``, ``BATCH``, ``OUT``, ``IN``), and the activation
between two layers lies in one :class:`Layout`. A weighted layer (``Linear``,
``Conv2d``, ``Embedding``, attention projections) may take any split; an
elementwise one passes any layout but ``PARTIAL`` through; a layer dreampipe
cannot read takes ``REPLICA`` or ``BATCH``. A weighted layer with an
elementwise tail (``Linear(...) + ReLU()``) reduces an ``IN`` split's sum
inside itself. :func:`reshard_bytes` prices turning one layout into another,
forward and backward, as ring collectives move them. Sizes are the
profile's, for the whole minibatch. The tables: docs/design.md §10.1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from dreampipe.profiling.graph import Layer

__all__ = ["Collective", "Layout", "OpKind", "Split", "SplitCost", "attention_heads",
           "layer_splits", "op_kind", "reshard", "split_cost", "splits_for"]


class Split(Enum):
    """How one layer's work is divided among the ``t`` workers of its group."""

    REPLICA = "replica"
    BATCH = "batch"
    OUT = "out"
    IN = "in"


class Layout(Enum):
    """How an activation (and its gradient) lies across the workers."""

    REPLICATED = "replicated"
    BATCH = "batch"
    FEATURE = "feature"
    PARTIAL = "partial"


class OpKind(Enum):
    """What the splitter knows about a layer, read from its description."""

    WEIGHTED = "weighted"
    ELEMENTWISE = "elementwise"
    OTHER = "other"


class Collective(Enum):
    """A ring collective over ``t`` workers; :meth:`wire_fraction` of the tensor each sends."""

    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE = "all-reduce"
    ALL_TO_ALL = "all-to-all"

    def wire_fraction(self, t: int) -> float:
        """Bytes each worker sends, as a fraction of the whole tensor (ring algorithms)."""
        if t <= 1:
            return 0.0
        if self is Collective.ALL_REDUCE:
            return 2 * (t - 1) / t
        if self is Collective.ALL_TO_ALL:
            return (t - 1) / t**2
        return (t - 1) / t

    def steps(self, t: int) -> int:
        """Latency-bound message rounds: ``t - 1`` per ring pass."""
        if t <= 1:
            return 0
        return 2 * (t - 1) if self is Collective.ALL_REDUCE else t - 1


_WEIGHTED = re.compile(r"^(Linear|Conv[123]d|Embedding|LazyLinear|Bilinear)\b")
_ELEMENTWISE = re.compile(
    r"^(ReLU|ReLU6|GELU|SiLU|Tanh|Sigmoid|LeakyReLU|ELU|Dropout\d?d?|Identity|Softplus|Mish)\b"
)

_HEADS = re.compile(r"\battention\((\d+) heads\)")

_SPLITS = {
    OpKind.WEIGHTED: (Split.REPLICA, Split.BATCH, Split.OUT, Split.IN),
    OpKind.ELEMENTWISE: (Split.REPLICA, Split.BATCH, Split.OUT),
    OpKind.OTHER: (Split.REPLICA, Split.BATCH),
}


def op_kind(layer: Layer) -> OpKind:
    """The layer's kind from its description (``Linear(4, 8)``, ``ReLU()``...)."""
    text = layer.description.strip()
    if _WEIGHTED.match(text) and layer.parameter_bytes > 0:
        return OpKind.WEIGHTED
    if is_elementwise(text):
        return OpKind.ELEMENTWISE
    return OpKind.OTHER


def is_elementwise(description: str) -> bool:
    """Whether a layer described so (its module's ``repr``) acts on each value alone, so
    that it runs on features split over workers as on whole ones."""
    return _ELEMENTWISE.match(description.strip()) is not None


def splits_for(kind: OpKind) -> tuple[Split, ...]:
    """The splits a layer of ``kind`` can run under (an elementwise ``OUT`` keeps features
    split: it passes a ``FEATURE`` activation through)."""
    return _SPLITS[kind]


def attention_heads(layer: Layer) -> int | None:
    """The attention heads a layer's description names (``... + attention(12 heads)``)."""
    found = _HEADS.search(layer.description)
    return int(found.group(1)) if found else None


def layer_splits(layer: Layer, t: int) -> tuple[Split, ...]:
    """The splits ``layer`` can run under over ``t`` workers: its kind's, but a layer that
    ends in attention splits its output by whole heads (Megatron-LM's rule: ``t`` divides
    the heads) and never its input, whose partial sums attention cannot take."""
    heads = attention_heads(layer)
    if heads is None:
        return splits_for(op_kind(layer))
    return tuple(x for x in splits_for(op_kind(layer))
                 if x is not Split.IN and (x is not Split.OUT or heads % t == 0))


@dataclass(frozen=True)
class SplitCost:
    """One layer under one split on ``t`` workers, per worker and per minibatch.

    ``compute_ms`` is its forward plus backward share; ``weight_bytes`` its
    share of the weights (the gradients take as much again); ``activation_bytes``
    its share of the output it stashes for the backward; ``collectives`` the
    collectives it runs itself, each with the bytes of the whole tensor: the
    weight-gradient all-reduce of a batch split, the input-gradient all-reduce
    of an output split.
    """

    split: Split
    needs: Layout
    gives: Layout
    compute_ms: float
    weight_bytes: float
    activation_bytes: float
    collectives: tuple[tuple[Collective, float], ...] = ()


def split_cost(layer: Layer, kind: OpKind, split: Split, t: int,
               input_bytes: float = 0.0) -> SplitCost:
    """What ``layer`` (whose input is ``input_bytes``) costs each of ``t`` workers."""
    if split not in splits_for(kind) or (t > 1 and split not in layer_splits(layer, t)):
        raise ValueError(f"a {kind.value} layer ({layer.name!r}) cannot take split "
                         f"{split.value} over {t} workers")
    w, a, c = float(layer.parameter_bytes), float(layer.activation_bytes), layer.compute_ms
    if split is Split.REPLICA:
        return SplitCost(split, Layout.REPLICATED, Layout.REPLICATED, c, w, a)
    if split is Split.BATCH:
        sync = ((Collective.ALL_REDUCE, w),) if w > 0 else ()
        return SplitCost(split, Layout.BATCH, Layout.BATCH, c / t, w, a / t, sync)
    if kind is OpKind.ELEMENTWISE:  # OUT on an elementwise layer: features stay split
        return SplitCost(split, Layout.FEATURE, Layout.FEATURE, c / t, w, a / t)
    if split is Split.OUT:
        return SplitCost(split, Layout.REPLICATED, Layout.FEATURE, c / t, w / t, a / t,
                         ((Collective.ALL_REDUCE, input_bytes),))
    if _elementwise_tail(layer):  # the tail is nonlinear in the sum: reduce it first
        return SplitCost(split, Layout.FEATURE, Layout.REPLICATED, c / t, w / t, a,
                         ((Collective.ALL_REDUCE, a),))
    return SplitCost(split, Layout.FEATURE, Layout.PARTIAL, c / t, w / t, a)


def _elementwise_tail(layer: Layer) -> bool:
    """Whether ``layer`` is a weighted module followed by elementwise ones, as a profiled
    block describes itself: ``Linear(...) + ReLU()``."""
    parts = layer.description.split(" + ")
    return len(parts) > 1 and all(_ELEMENTWISE.match(x.strip()) for x in parts[1:])


# (from, to) -> (forward collective, backward collective); missing pairs are free
_RESHARD: dict[tuple[Layout, Layout], tuple[Collective | None, Collective | None]] = {
    (Layout.REPLICATED, Layout.BATCH): (None, Collective.ALL_GATHER),
    (Layout.REPLICATED, Layout.FEATURE): (None, Collective.ALL_GATHER),
    (Layout.BATCH, Layout.REPLICATED): (Collective.ALL_GATHER, None),
    (Layout.FEATURE, Layout.REPLICATED): (Collective.ALL_GATHER, None),
    (Layout.BATCH, Layout.FEATURE): (Collective.ALL_TO_ALL, Collective.ALL_TO_ALL),
    (Layout.FEATURE, Layout.BATCH): (Collective.ALL_TO_ALL, Collective.ALL_TO_ALL),
    (Layout.PARTIAL, Layout.REPLICATED): (Collective.ALL_REDUCE, None),
    (Layout.PARTIAL, Layout.BATCH): (Collective.REDUCE_SCATTER, Collective.ALL_GATHER),
    (Layout.PARTIAL, Layout.FEATURE): (Collective.REDUCE_SCATTER, Collective.ALL_GATHER),
}


def reshard(src: Layout, dst: Layout) -> tuple[Collective | None, Collective | None]:
    """The collectives that turn an activation from ``src`` into ``dst`` (forward) and
    bring its gradient back (backward); ``(None, None)`` when nothing moves.

    Slicing a replicated tensor is free forward, but its gradient comes back
    split and is gathered; a partial sum is reduced forward and its gradient,
    needed whole by every worker's partial product, is gathered back.
    """
    if src is dst:
        return None, None
    if dst is Layout.PARTIAL:
        raise ValueError(f"no layer takes a partial sum as input (asked {src.value} -> partial)")
    return _RESHARD[(src, dst)]

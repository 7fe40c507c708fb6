"""The graphs of a model traced with its inputs' shapes known, one set per input signature.

A forward that branches on shapes is traced with the example's shapes known
(:mod:`.tracer`), and those shapes become constants of its graph: run on
inputs of other shapes (another sequence length, a smaller last batch, an
evaluation batch) it would compute something else, silently, or fail. So
the segments of such a trace run the graph of their inputs' *signature*
(each model input's shape and dtype, each constant's value): the first
segment computes it from the model's inputs, a cut carries it to the next
stage (:mod:`.pack`), and a signature not met before re-traces the model, on
``meta`` tensors of those shapes, on the rank that meets it; besides the
example's, the graphs of the last :data:`KEPT_SIGNATURES` signatures used are
kept, so a stream of ever new lengths holds no more. Every stage derives its
graphs from the same trace of the same signature, so the stages agree without
talking. A re-trace that cuts the model into other blocks, or
reads modules its stage does not hold, is a PlanError naming the shapes.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch.utils import _pytree as pytree

from dreampipe.errors import PlanError

__all__ = ["KEPT_SIGNATURES", "ShapeGraphs", "Signature", "signature"]

#: The model inputs' shapes, dtypes and constants, as JSON (it travels in a pack's header).
Signature = str
#: A re-trace: the model's inputs (meta tensors and constants) to its segments' labels and
#: graphs.
Retrace = Callable[[list[Any]], list[tuple[str, fx.Graph]]]
#: Signatures whose graphs a model keeps besides its example's (one graph a segment each),
#: the least recently used dropped first.
KEPT_SIGNATURES = 64


def signature(values: Sequence[Any]) -> Signature:
    """The signature of the first segment's input ``values``."""
    leaves, spec = pytree.tree_flatten(list(values))
    return json.dumps({"spec": pytree.treespec_dumps(spec), "leaves": [
        ["t", list(t.shape), str(t.dtype).removeprefix("torch.")] if isinstance(t, Tensor)
        else ["c", t] for t in leaves]}, default=repr)


def _inputs(sig: Signature) -> list[Any]:
    """Meta tensors and constants with signature ``sig``."""
    desc = json.loads(sig)
    leaves = [torch.empty(rest[0], dtype=getattr(torch, rest[1]), device="meta")
              if kind == "t" else rest[0] for kind, *rest in desc["leaves"]]
    return list(pytree.tree_unflatten(leaves, pytree.treespec_loads(desc["spec"])))


def _describe(sig: Signature) -> str:
    return ", ".join(f"{rest[1]} {rest[0]}" if kind == "t" else repr(rest[0])
                     for kind, *rest in json.loads(sig)["leaves"])


def _targets(graph: fx.Graph) -> set[str]:
    return {str(n.target) for n in graph.nodes if n.op in ("call_module", "get_attr")}


class ShapeGraphs:
    """The graphs of one model's segments by input signature, starting from the traced
    example's; shared by the segments and their copies."""

    def __init__(self, retrace: Retrace, traced: Signature,
                 segments: list[tuple[str, fx.Graph]], kept: int = KEPT_SIGNATURES) -> None:
        self._retrace = retrace
        self.traced = traced
        self._labels = [label for label, _ in segments]
        self._example = [g for _, g in segments]
        self._kept = kept
        self._graphs: OrderedDict[Signature, list[fx.Graph]] = OrderedDict()
        #: How many times the model was traced again (a signature new, or dropped since).
        self.traces = 0

    def graph(self, index: int, sig: Signature | None) -> fx.Graph:
        """Segment ``index``'s graph for inputs of ``sig`` (None: the traced example's)."""
        if sig is None or sig == self.traced:
            return self._example[index]
        found = self._graphs.get(sig)
        if found is None:
            found = self._graphs[sig] = self._trace(sig)
            self.traces += 1
            if len(self._graphs) > self._kept:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(sig)
        return found[index]

    @property
    def signatures(self) -> list[Signature]:
        """The signatures kept besides the example's, the least recently used first."""
        return list(self._graphs)

    def _trace(self, sig: Signature) -> list[fx.Graph]:
        fix = ("give every batch the example's shapes (pad sequences to its length; "
               "drop_last=True drops a short last batch), or remove the branch on shapes")
        shapes = f"inputs {_describe(sig)} (the example's: {_describe(self.traced)})"
        try:
            cut = self._retrace(_inputs(sig))
        except Exception as exc:
            raise PlanError(f"the model's forward branches on its inputs' shapes and cannot be "
                            f"traced for {shapes} ({type(exc).__name__}: {exc}); {fix}") from exc
        labels = [label for label, _ in cut]
        if labels != self._labels:
            raise PlanError(f"the model's forward branches on its inputs' shapes: for {shapes} "
                            f"it calls {labels}, not {self._labels}; {fix}")
        for (label, g), old in zip(cut, self._example, strict=True):
            extra = _targets(g) - _targets(old)
            if extra:
                raise PlanError(f"the model's forward branches on its inputs' shapes: for "
                                f"{shapes} its part at {label!r} reads {sorted(extra)}, which "
                                f"the example's does not; {fix}")
        return [g for _, g in cut]

    def __deepcopy__(self, memo: dict[int, Any]) -> ShapeGraphs:
        return self

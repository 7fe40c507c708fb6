"""The graph a traced model's evaluation runs: its forward traced again in eval mode.

fx reads ``self.training`` while tracing, as a Python value: a top-level
``if self.training:`` or ``F.dropout(x, p, self.training)`` between the units
is baked into the graph as it was at the trace (training), and the units'
own modes, which ``eval()`` switches, do not reach it. So the forward is
traced a second time with every module in eval mode; where a segment's code
differs, the segment runs that graph while its stage is in eval mode. The two
must cut alike (the same segments, each taking and passing on as many values,
reading no module the training graph does not), so that an evaluation's
messages are training's; otherwise, or where the shapes are baked in
(:mod:`.shape_graphs`, traced in training mode), an evaluation is refused
with the reason. docs/design.md §2.1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch import nn

from dreampipe.splitter.fx_tracer import trace_model

__all__ = ["eval_graphs"]

_log = logging.getLogger(__name__)

Cut = list[tuple[str, fx.Graph]]


def _code(graph: fx.Graph) -> str:
    return graph.python_code("self").src


def _targets(graph: fx.Graph) -> set[str]:
    return {str(n.target) for n in graph.nodes if n.op in ("call_module", "get_attr")}


def _passes(graph: fx.Graph) -> tuple[int, int]:
    """How many values the segment takes, and returns (1: the model's output)."""
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    given = sum(n.op == "placeholder" for n in graph.nodes)
    return given, len(out) if isinstance(out, tuple) else 1


def _traced_in_eval(model: nn.Module, units: set[str], example: Any, baked: bool
                    ) -> fx.Graph:
    """``model``'s forward traced with every module in eval mode, each module's own mode
    restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        return trace_model(model, units, example, shapes_known=baked, again=True)[0]
    finally:
        for m, mode in modes:
            m.training = mode


def eval_graphs(model: nn.Module, units: set[str], example: Any, cut: Cut, baked: bool,
                cut_again: Callable[[fx.Graph], Cut]) -> list[fx.Graph | None] | str:
    """Per segment of ``cut`` (``model`` traced in its own modes, cut by ``cut_again``),
    the graph to evaluate with, None where it is the same; or, where evaluation cannot
    run on these cuts, why (completing "the model's forward ...")."""
    try:
        again = cut_again(_traced_in_eval(model, units, example, baked))
    except Exception as exc:  # the eval branch may hold what the training one does not
        _log.debug("tracing %s in eval mode failed: %s", type(model).__name__, exc)
        return (f"cannot be traced in eval mode ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})")
    alike = [label for label, _ in again] == [label for label, _ in cut]
    same = [_code(a) == _code(t) for (_, t), (_, a) in zip(cut, again, strict=True)
            ] if alike else []
    if alike and all(same):
        return [None] * len(cut)
    why = ("reads self.training between its blocks, and in eval mode it calls them in "
           "another order" if not alike else
           "reads self.training between its blocks, and in eval mode its segments pass on "
           "other values or read other modules" if any(
               _passes(a) != _passes(t) or not _targets(a) <= _targets(t)
               for (_, t), (_, a) in zip(cut, again, strict=True)) else
           "reads self.training between its blocks, and its trace baked the example's "
           "shapes in, in training mode" if baked else "")
    if why:
        return why
    return [None if equal else a for equal, (_, a) in zip(same, again, strict=True)]

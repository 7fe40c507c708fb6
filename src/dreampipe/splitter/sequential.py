"""An ``nn.Sequential`` model as its children, each one layer.

A Sequential whose children take one tensor and pass one tensor on is cut
between its children as they are: a stage calls its children one after the
other and sends the tensor the last returns. One whose input is a tuple or a
dict (given to the first child as it is, as ``model(x)`` does), or whose
children pass anything else on (a tuple of a hidden state and a mask,
a dict), becomes one :class:`~dreampipe.splitter.segments.Segment` per child instead,
so its cuts carry any pytree of tensors and constants (:mod:`.pack`), as a
traced model's do. Which children pass what is found by running the model on
the ``meta`` device on the example (shapes only, no memory, no compute); a
model that does not run there whole is cut between its children as they are,
and the stage checks say what a cut may pass.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import Tensor, nn

from dreampipe.splitter.fx_tracer import call_on_meta, on_meta
from dreampipe.splitter.segments import Segment

__all__ = ["passes_one_tensor", "sequential_entries", "sequential_segments"]


def sequential_entries(model: nn.Sequential) -> list[tuple[str, nn.Module]]:
    """``model``'s entries as it calls them, each under its name: a module listed twice (a
    reused activation, ``Sequential(block, block)``) is two entries, where
    ``named_children()`` keeps one and drops the second call."""
    return [(name, child) for name, child in model._modules.items() if child is not None]


def passes_one_tensor(model: nn.Sequential, example: Any) -> bool:
    """Whether ``model`` takes one tensor (``example``; None: not known, taken as one) and
    each child but the last returns one tensor on it. A model that does not run whole on
    ``meta`` (an op without a meta kernel, a child that cannot take what the one before
    returns) is taken as one that does: its cuts are checked as they run."""
    if example is None:
        return True
    if not isinstance(example, Tensor):
        return False
    x: Any = on_meta(example)
    crossed = False
    try:
        for i, (_, child) in enumerate(sequential_entries(model)):
            crossed = crossed or (i > 0 and not isinstance(x, Tensor))
            x = call_on_meta(child, (x,))
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError):
        return True
    return not crossed


def sequential_segments(model: nn.Sequential, example: Any) -> list[tuple[str, Segment]]:
    """One segment per child of ``model``: the first calls its child with the model's input
    as it is (``model(x)``: a tensor, a tuple or a dict, as ``example``), each other with
    what the previous child returned."""
    names = [name for name, _ in sequential_entries(model)]
    out: list[tuple[str, Segment]] = []
    for i, name in enumerate(names):
        g = fx.Graph()
        arg: Any
        if i > 0:
            arg = g.placeholder("in_0")
        elif isinstance(example, dict):
            arg = {k: g.placeholder(k) for k in example}
        elif isinstance(example, tuple):
            arg = tuple(g.placeholder(f"input_{k}") for k in range(len(example)))
        else:
            arg = g.placeholder("input")
        node = g.call_module(name, (arg,))
        g.output(node if i == len(names) - 1 else (node,))
        segment = Segment(model, g, name, i, len(names))
        segment.tuple_input = i == 0 and isinstance(example, tuple)
        out.append((name, segment))
    return out

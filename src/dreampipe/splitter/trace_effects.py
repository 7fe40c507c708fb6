"""What tracing a forward did to the model, undone.

fx runs the forward's Python once, on proxies: ``self.count = self.count + 1``
on a buffer rebinds the buffer to a proxy (the model is then broken for
PyTorch too; ``self.count += 1`` only seems to, as the graph writes the buffer
in place), and on a plain number it runs once, at the trace, so the graph keeps the traced
value for good. :func:`undone` puts every module's parameters, buffers and
plain values back as they were and reports what the forward changed; the
tracer refuses a rebound tensor (update it in place, which the graph keeps)
and warns of a changed value (it stays the traced one). docs/design.md §2.1.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch.fx as fx
from torch import nn

from dreampipe.errors import PlanError
from dreampipe.splitter.in_place import IN_PLACE_OPERATORS

__all__ = ["undone"]

_log = logging.getLogger(__name__)

_PLAIN = (bool, int, float, str, type(None))


def _written_in_place(value: object, target: str) -> bool:
    """Whether ``value`` is a traced in-place operator's result on attribute ``target``
    (``self.count += 1``): the graph writes the attribute, so it is not rebound."""
    node = getattr(value, "node", None)
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target in IN_PLACE_OPERATORS.values() and bool(node.args)
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"
            and node.args[0].target == target)


@contextlib.contextmanager
def undone(model: nn.Module, warn: bool = True) -> Iterator[None]:
    """Run the body (a trace of ``model``), then restore each module's parameters,
    buffers and plain values; a PlanError where the body rebound a parameter or buffer,
    a warning where it changed a plain value (module doc; ``warn``: say so)."""
    kept = [(name, m, dict(m._parameters), dict(m._buffers),
             {k: v for k, v in vars(m).items() if isinstance(v, _PLAIN)})
            for name, m in model.named_modules()]
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        rebound, changed = [], []
        for name, m, params, buffers, plain in kept:
            prefix = f"{name}." if name else ""
            for own, was in ((m._parameters, params), (m._buffers, buffers)):
                for k, v in was.items():
                    if own.get(k) is not v:
                        if not _written_in_place(own.get(k), f"{prefix}{k}"):
                            rebound.append(f"self.{prefix}{k}")
                        own[k] = v
            for k, v in plain.items():
                now = vars(m).get(k, v)
                if now is not v and not (isinstance(now, _PLAIN) and now == v
                                         and type(now) is type(v)):
                    changed.append(f"self.{prefix}{k}")
                    setattr(m, k, v)
        if rebound and not failed:
            raise PlanError(
                f"its forward assigns {', '.join(rebound)}, a tensor the model holds, anew "
                "(e.g. self.count += 1): a traced forward cannot rebind it; update it in "
                f"place, e.g. {rebound[0]}.add_(1) or {rebound[0]}.copy_(new)")
        if changed and warn and not failed:
            _log.warning(
                "%s's forward changes %s, a plain Python value, which a traced forward "
                "runs once, when traced: training keeps the traced value; keep what "
                "changes in a buffer updated in place (register_buffer, .add_(1))",
                type(model).__name__, ", ".join(changed))

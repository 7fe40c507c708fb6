"""Linear layers that add their weight gradient straight into the update's gradient.

``nn.Linear`` layers compute ``acc += g^T x`` with one GEMM (``addmm_``) and
autograd carries the input gradient only; layers under ``torch.autocast``
and other layers keep autograd's path. The post-accumulate-grad hooks still
run after every GEMM that adds to a parameter, which is how
:class:`~dreampipe.runtime.stage_module.StageModule` knows a gradient is
final. A stage may hold the weight GEMMs (:class:`DeferredGradients`) until
its input gradient is sent; :attr:`LinearGradients.PLAIN` holds them with
autograd's kernels. Why and how: docs/design.md §5.3 (and §7.6).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from enum import Enum
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dreampipe.profiling.layer_memory import RUNTIME_LINEARS

__all__ = [
    "DeferredGradients", "GradientSink", "GradientSum", "HeldWork", "LinearGradients",
    "fuse_linear_gradients", "fused_indices", "is_fused_node", "linears_as_a_stage",
]


class LinearGradients(Enum):
    """How a stage's ``nn.Linear`` layers make their weight gradients."""

    #: One GEMM adds each microbatch's gradient into the update's (``acc.addmm_(g^T, x)``).
    FUSED = "fused"
    #: Autograd's kernels, a GEMM and then an add (``acc += g^T x``), in the same order
    #: as FUSED: a stage that sends an input gradient holds the GEMMs until it is sent.
    PLAIN = "plain"
    #: The layers are left alone: autograd's own path, nothing held (a split stage's
    #: sharded weights take this path).
    AUTOGRAD = "autograd"

    @classmethod
    def of(cls, fused_accumulation: bool) -> LinearGradients:
        """The users' switch (``fused_accumulation``): FUSED, or PLAIN to compare kernels alike."""
        return cls.FUSED if fused_accumulation else cls.PLAIN


class GradientSink(Protocol):
    """Where fused layers put weight gradients (by parameter index)."""

    def add_grad_mm(self, index: int, a: Tensor, b: Tensor) -> None:
        """``grad[index] += a @ b``."""

    def add_grad(self, index: int, g: Tensor) -> None:
        """``grad[index] += g``."""


class GradientSum:
    """The update's weight gradients: one buffer per parameter, summed over its microbatches.

    A :class:`GradientSink`: with ``fused``, a Linear weight's GEMM adds into
    the buffer (``addmm_``); without, it is a GEMM and an add, as autograd
    makes it. A microbatch's first term becomes the buffer, with no copy. After
    :meth:`close` new terms go to the next update's sums, which :meth:`take` starts from.
    """

    def __init__(self, params: list[nn.Parameter], *, fused: bool) -> None:
        self._params = params
        self._fused = fused
        self._sums: list[Tensor | None] = [None] * len(params)
        self._arrived: set[int] = set()
        #: what the update's microbatches gave a gradient term, kept across :meth:`pop`
        self._used: set[int] = set()
        #: the next update's, while this one's is closed (all-reduced in flight)
        self._next: GradientSum | None = None

    def close(self) -> None:
        """The update's sums are whole: later terms are the next update's (a deferred
        step's all-reduce is in flight, :mod:`dreampipe.scheduling.updates`)."""
        self._next = GradientSum(self._params, fused=self._fused)

    def __getitem__(self, index: int) -> Tensor | None:
        return self._sums[index]

    def add_grad_mm(self, index: int, a: Tensor, b: Tensor) -> None:
        if self._next is not None:
            self._next.add_grad_mm(index, a, b)
            return
        acc = self._sums[index]
        if acc is not None and self._fused:
            acc.addmm_(a, b)
            self._arrived.add(index)
            self._used.add(index)
        else:
            self.add_grad(index, torch.mm(a, b))

    def add_grad(self, index: int, g: Tensor) -> None:
        if self._next is not None:
            self._next.add_grad(index, g)
            return
        acc = self._sums[index]
        if acc is None:
            self._sums[index] = g
        else:
            acc.add_(g)
        self._arrived.add(index)
        self._used.add(index)

    def used(self) -> frozenset[int]:
        """The parameters the update's microbatches on this replica gave a gradient."""
        return frozenset(self._used)

    def arrive(self, indices: Iterable[int]) -> None:
        """These sums count, zeros included: an all-reduce over the replicas wrote them,
        and some replica's microbatches used each parameter."""
        self._arrived.update(indices)

    def filled(self, index: int) -> Tensor:
        """Parameter ``index``'s sum, zeros (kept) if nothing arrived; zeros that stay
        zeros are still no gradient to :meth:`take`."""
        acc = self._sums[index]
        if acc is None:
            acc = torch.zeros_like(self._params[index])
            self._sums[index] = acc
        return acc

    def has(self, index: int) -> bool:
        """Whether parameter ``index``'s sum counts: a term arrived, or an all-reduce over
        the replicas said some replica used it."""
        return index in self._arrived

    def keep(self, index: int, g: Tensor | None) -> None:
        """Parameter ``index``'s sum is ``g`` (a tied weight's, summed over its copies);
        None: no copy used it, so it gets no gradient."""
        self._sums[index] = g
        if g is None:
            self._arrived.discard(index)
            return
        self._arrived.add(index)
        self._used.add(index)

    def pop(self, index: int) -> Tensor:
        """Parameter ``index``'s sum (zeros if nothing arrived), which starts again."""
        acc = self.filled(index)
        self._sums[index] = None
        self._arrived.discard(index)
        return acc

    def take(self) -> list[Tensor | None]:
        """Every sum (None where nothing arrived: a parameter the update never used gets
        no gradient, as in one process), starting the next update's (from what came
        since :meth:`close`)."""
        sums = [s if i in self._arrived else None for i, s in enumerate(self._sums)]
        nxt, self._next = self._next, None
        if nxt is None:
            self._sums, self._arrived, self._used = [None] * len(self._params), set(), set()
        else:
            self._sums, self._arrived, self._used = nxt._sums, nxt._arrived, nxt._used
        return sums


#: A held weight-gradient term: ``(index, a, b)`` for ``grad += a @ b``, or
#: ``(index, g, None)`` for ``grad += g``.
HeldWork = list[tuple[int, Tensor, Tensor | None]]


class DeferredGradients:
    """A :class:`GradientSink` in front of ``sink`` that, while :attr:`holding`, keeps the
    weight GEMMs for :meth:`run` (in the order they came, so sums are bit for bit the same);
    while :attr:`holding_adds` too, it keeps the plain terms (a bias's row sum) as well."""

    def __init__(self, sink: GradientSink) -> None:
        self._sink = sink
        self._held: HeldWork = []
        self.holding = False
        self.holding_adds = False

    def add_grad_mm(self, index: int, a: Tensor, b: Tensor) -> None:
        if self.holding:
            self._held.append((index, a, b))
        else:
            self._sink.add_grad_mm(index, a, b)

    def add_grad(self, index: int, g: Tensor) -> None:
        if self.holding_adds:
            self._held.append((index, g, None))
        else:
            self._sink.add_grad(index, g)

    def take(self) -> HeldWork:
        """The terms held so far, for a later :meth:`run` (a microbatch's ``W``)."""
        held, self._held = self._held, []
        return held

    def run(self, work: HeldWork | None = None) -> None:
        """Do the held terms now, or ``work`` (what :meth:`take` returned); outside
        autograd's backward, so without grad mode (a saved input requires grad)."""
        with torch.no_grad():
            for index, a, b in self._held if work is None else work:
                if b is None:
                    self._sink.add_grad(index, a)
                else:
                    self._sink.add_grad_mm(index, a, b)
        if work is None:
            self._held.clear()


class _LinearAccumulate(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, sink: GradientSink,
        w_index: int, b_index: int | None,
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.w_index, ctx.b_index = sink, w_index, b_index
        # rows of any batch shape, into an output of its own (not a view, which the model
        # may not write in place without autograd copying it around the write)
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
        rows, into = x.reshape(-1, x.shape[-1]), out.view(-1, weight.shape[0])
        if bias is None:
            torch.mm(rows, weight.t(), out=into)
        else:
            torch.addmm(bias, rows, weight.t(), out=into)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None, None, None]:
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        ctx.sink.add_grad_mm(ctx.w_index, g2.t(), x.reshape(-1, x.shape[-1]))
        if ctx.b_index is not None:
            ctx.sink.add_grad(ctx.b_index, g2.sum(0))
        gx = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        return gx, None, None, None, None, None


def is_fused_node(node: object) -> bool:
    """Whether autograd node ``node`` is a fused layer's (its weight gradient goes to the
    sink, not through the graph)."""
    return isinstance(node, _LinearAccumulate._backward_cls)


def _forward(layer: nn.Linear, sink: GradientSink, w_index: int, b_index: int | None,
             x: Tensor) -> Tensor:
    weight, bias = layer.weight, layer.bias
    if (torch.is_grad_enabled() and weight.requires_grad and x.dim() >= 2
            and not torch.is_autocast_enabled(x.device.type)):
        out: Tensor = _LinearAccumulate.apply(  # type: ignore[no-untyped-call]
            x, weight, bias, sink, w_index, b_index
        )
        return out
    return F.linear(x, weight, bias)


def fuse_linear_gradients(module: nn.Module, names: list[str], sink: GradientSink) -> int:
    """Switch ``module``'s ``nn.Linear`` layers to fused accumulation; returns how many.

    ``names[i]`` is the name of the parameter whose gradient ``sink`` keeps at
    index ``i``. Layers with a parameter outside ``names`` (tied or frozen
    weights) keep the plain path.
    """
    fused = 0
    for layer, w_index, b_index in _fusable(module, names):
        layer.forward = partial(_forward, layer, sink, w_index, b_index)  # type: ignore[method-assign]
        fused += 1
    return fused


def fused_indices(module: nn.Module, names: list[str]) -> frozenset[int]:
    """The indices into ``names`` whose gradients :func:`fuse_linear_gradients` makes."""
    out: set[int] = set()
    for _, w_index, b_index in _fusable(module, names):
        out.update(i for i in (w_index, b_index) if i is not None)
    return frozenset(out)


def _fusable(module: nn.Module, names: list[str]) -> Iterator[tuple[nn.Linear, int, int | None]]:
    """Each ``nn.Linear`` whose parameters are all in ``names``, with their indices."""
    index = {name: i for i, name in enumerate(names)}
    for qual, layer in module.named_modules():
        if type(layer) is not nn.Linear:
            continue
        prefix = f"{qual}." if qual else ""
        w_index = index.get(f"{prefix}weight")
        b_index = index.get(f"{prefix}bias") if layer.bias is not None else None
        if w_index is None or (layer.bias is not None and b_index is None):
            continue
        yield layer, w_index, b_index


@contextmanager
def linears_as_a_stage(model: nn.Module) -> Iterator[GradientSum]:
    """Within: ``model``'s ``nn.Linear`` layers make their weight gradients as a stage
    does (a GEMM, then GEMMs adding into it) into the sink given, so a profile runs, and
    keeps, the runtime's kernels (:mod:`dreampipe.profiling.layer_memory`); as they were
    after."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sink = GradientSum([p for _, p in named], fused=True)
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    own = [m.__dict__.get("forward") for m in linears]
    try:
        fuse_linear_gradients(model, [n for n, _ in named], sink)
        yield sink
    finally:
        for m, forward in zip(linears, own, strict=True):
            if forward is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = forward


RUNTIME_LINEARS.append(linears_as_a_stage)

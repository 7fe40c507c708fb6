"""A microbatch's backward split in two: Zero Bubble's ``B`` and ``W`` (Qi et al., 2024).

``B`` (:func:`input_gradient`) computes only the gradient of the stage's
input, the one the stage before waits for, keeping the graph, and records the
gradient flowing into each *intermediate* node (on the input's path, and
leading to a weight). ``W`` (:func:`weight_gradients`), later, starts autograd
at those nodes and asks for the weights only, so it never redoes the input's
chain, as ``torch.distributed.pipelining``'s ``stage_backward_input`` and
``stage_backward_weight`` do. Fused ``nn.Linear`` layers (:mod:`.fused`) hold
their weight GEMMs for ``W`` (:class:`~.fused.DeferredGradients`). A rank's
``STEP`` follows its last ``W``, so the update is one process's, clipping and
skipped updates included (docs/design.md §7.8).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.utils.checkpoint
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from dreampipe.runtime.fused import DeferredGradients, HeldWork, is_fused_node

__all__ = ["WeightWork", "input_gradient", "weight_gradients"]


@dataclass
class _Group:
    """Weights sharing intermediates, and what ``B`` recorded at those intermediates."""

    params: list[tuple[int, Node]]
    nodes: list[Node]
    grads: list[tuple[Tensor | None, ...] | None] = field(default_factory=list)


@dataclass
class WeightWork:
    """What a microbatch's ``W`` still has to do: held fused terms, then autograd's groups."""

    held: HeldWork
    groups: list[_Group]


def _node(t: Tensor) -> Node | None:
    """``t``'s gradient node: its ``grad_fn``, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    view = t.view_as(t).grad_fn
    assert view is not None
    acc: Node | None = view.next_functions[0][0]
    return acc


def _consumers(root: Node) -> tuple[dict[Node, list[Node]], dict[Node, int]]:
    """Every node of ``root``'s graph with the nodes that feed gradient into it, and each
    node's place in a walk from ``root`` (a fixed order, so sums add up alike every run)."""
    out: dict[Node, list[Node]] = collections.defaultdict(list)
    queue, seen = collections.deque([root]), {root: 0}
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            out[nxt].append(node)
            if nxt not in seen:
                seen[nxt] = len(seen)
                queue.append(nxt)
    return out, seen


def _closure(start: Node, consumers: dict[Node, list[Node]],
             stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """The nodes from ``start`` towards the output, and those of ``stop`` met (not crossed)."""
    seen, met = {start}, set()
    queue = collections.deque([start])
    while queue:
        for node in consumers.get(queue.popleft(), ()):
            if node in seen:
                continue
            if node in stop:
                met.add(node)
                continue
            seen.add(node)
            queue.append(node)
    return seen, met


def _groups(root: Node, x: Node, leaves: Sequence[Tensor], skip: frozenset[int]) -> list[_Group]:
    """The weights grouped by the intermediates they are reached from.

    A weight of ``skip`` (a fused layer's) is left out only where this microbatch's
    graph reaches it through fused nodes alone: a fused layer that fell back to
    autograd's path (under autocast, say) is walked like any other weight.
    """
    consumers, order = _consumers(root)
    wanted = []
    for i, leaf in enumerate(leaves):
        node = _node(leaf)
        if node is None or node not in consumers:
            continue
        if i in skip and all(map(is_fused_node, consumers[node])):
            continue
        wanted.append((i, node))
    if not wanted:  # every weight fused (an mlp): no walk
        return []
    on_path, _ = _closure(x, consumers, set())
    by_node: dict[Node, _Group] = {}
    for i, node in wanted:
        _, met = _closure(node, consumers, on_path)
        group = _Group([(i, node)], sorted(met, key=order.__getitem__))
        for m in met:
            other = by_node.get(m)
            if other is not None and other is not group:
                group.params += other.params
                group.nodes = sorted({*group.nodes, *other.nodes}, key=order.__getitem__)
                for n in other.nodes:
                    by_node[n] = group
        for n in group.nodes:
            by_node[n] = group
    unique = {id(g): g for g in by_node.values()}
    return list(unique.values())


def input_gradient(
    out: Tensor, grad: Tensor | None, x: Tensor, leaves: Sequence[Tensor],
    held: DeferredGradients, skip: frozenset[int],
) -> tuple[Tensor, WeightWork]:
    """``B``: the gradient of ``x`` given the output's ``grad`` (None for a loss), and the
    microbatch's :class:`WeightWork` for ``leaves`` (those in ``skip`` are fused: held)."""
    root, xnode = out.grad_fn, _node(x)
    assert root is not None and xnode is not None
    groups = _groups(root, xnode, leaves, skip)
    handles = []
    for g in groups:
        g.grads = [None] * len(g.nodes)
        for k, node in enumerate(g.nodes):
            handles.append(node.register_prehook(_recorder(g, k)))
    held.holding = held.holding_adds = True
    try:
        (gx,) = torch.autograd.grad(out, [x], grad, retain_graph=True)
    finally:
        held.holding = held.holding_adds = False
        for h in handles:
            h.remove()
    return gx, WeightWork(held.take(), groups)


def _recorder(group: _Group, k: int) -> Callable[[tuple[Tensor | None, ...]], None]:
    def hook(grads: tuple[Tensor | None, ...]) -> None:
        group.grads[k] = grads
    return hook


def weight_gradients(work: WeightWork, held: DeferredGradients,
                     add: Callable[[int, Tensor], None]) -> None:
    """``W``: run the microbatch's held fused terms, then ``add(index, gradient)`` for every
    other weight its graph reaches."""
    held.run(work.held)
    with _one_recomputation():
        _group_gradients(work, held, add)
    work.groups.clear()


def _one_recomputation() -> AbstractContextManager[Any]:
    """Checkpointed blocks (:mod:`.block_recompute`) recompute once for all of ``W``'s
    groups, not once per group: the groups run disjoint parts of the graph, as
    ``GraphExecGroup`` asks (a torch without it recomputes per group)."""
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    return nullcontext() if group is None else cast(AbstractContextManager[Any], group())


def _group_gradients(work: WeightWork, held: DeferredGradients,
                     add: Callable[[int, Tensor], None]) -> None:
    for g in work.groups:
        edges: list[Any] = []
        grads: list[Tensor] = []
        handles = []
        for node, recorded in zip(g.nodes, g.grads, strict=True):
            if recorded is None:
                continue
            for k, t in enumerate(recorded):
                if t is not None:
                    edges.append(GradientEdge(node, k))
                    grads.append(t)
            if len(g.nodes) > 1:
                handles.append(node.register_prehook(_pinned(recorded)))
        if not edges:
            continue
        held.holding = held.holding_adds = True
        try:
            found = torch.autograd.grad(
                edges, [GradientEdge(n, 0) for _, n in g.params], grads,
                retain_graph=True, allow_unused=True)
        finally:
            held.holding = held.holding_adds = False
            held.take()
            for h in handles:
                h.remove()
        for (i, _), dw in zip(g.params, found, strict=True):
            if dw is not None:
                add(i, dw)


def _pinned(recorded: tuple[Tensor | None, ...]) -> Callable[[Any], tuple[Tensor | None, ...]]:
    def hook(_grads: Any) -> tuple[Tensor | None, ...]:
        return recorded
    return hook

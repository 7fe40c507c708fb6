"""In-place writes in a traced forward: kept in place, and kept visible across cuts.

fx's proxies have no in-place operators, so Python runs ``s += 1`` as
``s = s + 1``: a graph without the write, where one process's views of ``s``
(``cls = s[:, 0]``) see it. The tracer gives its proxies the in-place
operators (:data:`IN_PLACE_OPERATORS`), so the graph writes where the forward
does. A cut then parts a view from what it views: values that cross a cut
travel as separate tensors. The trace knows each node's meta value, so
:func:`note` records the tensor each value's memory belongs to (its *root*)
and the roots a node writes (their version counters moved); at each cut
where two crossing values share a root that a later node writes,
:func:`rejoin_views` rebuilds the views after the cut from the crossing value
they view, as one process computes them, and refuses, naming them, aliases
that no chain of view ops joins. docs/design.md §2.1.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import Tensor
from torch.utils import _pytree as pytree

from dreampipe.errors import PlanError

__all__ = [
    "IN_PLACE_OPERATORS", "carry", "live_values", "note", "rejoin_views", "versions", "written",
]

#: A proxy's in-place operators (``__iadd__``...) and the functions its nodes call.
IN_PLACE_OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    "__iadd__": operator.iadd, "__isub__": operator.isub, "__imul__": operator.imul,
    "__itruediv__": operator.itruediv, "__ifloordiv__": operator.ifloordiv,
    "__imod__": operator.imod, "__ipow__": operator.ipow, "__imatmul__": operator.imatmul,
    "__iand__": operator.iand, "__ior__": operator.ior, "__ixor__": operator.ixor,
    "__ilshift__": operator.ilshift, "__irshift__": operator.irshift,
}
_IN_PLACE_FUNCTIONS = (operator.setitem, *IN_PLACE_OPERATORS.values())
_KEY = "dreampipe_alias"
_VIEW_CHAIN_LIMIT = 64

#: A tensor's version counter and the tensor, by the tensor's id.
Versions = dict[int, tuple[Tensor, int]]


@dataclass(frozen=True)
class _Alias:
    """What a node's meta value says of memory: ``root``, the tensor its value's memory
    belongs to (None: no tensor); ``view``, whether an op that writes nothing made it from
    its first argument's memory (a view, or that tensor itself); ``writes``, the roots it
    wrote in place."""

    root: Tensor | None
    view: bool
    writes: tuple[Tensor, ...]


def _root(t: Tensor) -> Tensor:
    return t if t._base is None else t._base


def versions(tree: Any) -> Versions:
    """The version counters of the roots of the tensors in ``tree`` (an op's arguments'
    meta values), read before the op runs."""
    out: Versions = {}
    for t in pytree.tree_leaves(tree):
        if isinstance(t, Tensor):
            root = _root(t)
            out[id(root)] = (root, root._version)
    return out


def note(node: fx.Node, value: Any, args: Any, before: Versions) -> None:
    """Record on ``node`` what its meta ``value``, computed from the meta values ``args``
    whose roots' versions were ``before``, says of memory (:class:`_Alias`)."""
    writes = tuple(root for root, version in before.values() if root._version != version)
    first = next(iter(pytree.tree_leaves(args)), None)
    view = (isinstance(value, Tensor) and isinstance(first, Tensor) and not writes
            and _root(value) is _root(first))
    node.meta[_KEY] = _Alias(_root(value) if isinstance(value, Tensor) else None, view, writes)


def _alias(node: Any) -> _Alias | None:
    return node.meta.get(_KEY) if isinstance(node, fx.Node) else None


def carry(source: fx.Node, target: fx.Node) -> None:
    """Give ``target`` (a segment's placeholder for ``source``) what the trace recorded of
    ``source``'s memory."""
    if _KEY in source.meta:
        target.meta[_KEY] = source.meta[_KEY]


def written(graph: fx.Graph) -> list[fx.Node]:
    """The attributes and inputs ``graph`` writes in place (``buf.mul_(0.9).add_(x)``,
    ``buf[0] = x``, ``h += s``, ``h[:, 0].zero_()``): an in-place call's first argument, back
    through in-place calls and, where the trace recorded them, views; and, where it recorded
    memory, any whose memory a node writes (``F.relu(h, inplace=True)``, a unit writing
    its input)."""
    roots = [r for node in graph.nodes for r in getattr(_alias(node), "writes", ())]
    out = [n for n in graph.nodes if n.op in ("get_attr", "placeholder") and any(
        getattr(_alias(n), "root", None) is r for r in roots)]
    for node in graph.nodes:
        if not ((node.op == "call_method" and node.target.endswith("_")
                 and not node.target.endswith("__"))
                or (node.op == "call_function" and node.target in _IN_PLACE_FUNCTIONS)):
            continue
        base = node.args[0] if node.args else None
        while isinstance(base, fx.Node) and base.op in ("call_method", "call_function") and (
                str(base.target).endswith("_") or base.target in _IN_PLACE_FUNCTIONS
                or getattr(_alias(base), "view", False)) and base.args:
            base = base.args[0]
        if (isinstance(base, fx.Node) and base.op in ("get_attr", "placeholder")
                and base not in out):
            out.append(base)
    return out


def live_values(graph: fx.Graph, seg_of: dict[fx.Node, int], s: int) -> list[fx.Node]:
    """The values that cross the cut after segment ``s`` (``seg_of``: each node's segment;
    the output node's is past the last)."""
    return [n for n in graph.nodes if n.op != "get_attr" and n in seg_of and seg_of[n] <= s
            and any(seg_of.get(u, 0) > s for u in n.users)]


def _chain(base: fx.Node, view: fx.Node) -> list[fx.Node] | None:
    """The view ops that make ``view`` from ``base``, first first; None if none do."""
    out: list[fx.Node] = []
    node = view
    while node is not base:
        alias = _alias(node)
        if (alias is None or not alias.view or node.op not in ("call_function", "call_method")
                or not node.args or not isinstance(node.args[0], fx.Node)
                or len(out) == _VIEW_CHAIN_LIMIT):
            return None
        out.append(node)
        node = node.args[0]
    return out[::-1]


def _joined(members: list[fx.Node]) -> tuple[fx.Node, dict[fx.Node, list[fx.Node]]] | None:
    """A member every other member is a view chain of, and those chains; None if none."""
    for base in members:
        chains = {v: _chain(base, v) for v in members if v is not base}
        if all(c is not None for c in chains.values()):
            return base, {v: c for v, c in chains.items() if c is not None}
    return None


def _writers(nodes: Iterable[fx.Node], root: Tensor) -> list[fx.Node]:
    return [n for n in nodes if any(w is root for w in getattr(_alias(n), "writes", ()))]


def rejoin_views(graph: fx.Graph, seg_of: dict[fx.Node, int], starts: list[fx.Node],
                 what: str) -> None:
    """Rebuild, after each cut, the crossing views of a crossing value that a later node
    writes in place (module doc); ``seg_of`` (each node's segment) takes the new nodes,
    ``starts`` are the segments' unit calls, ``what`` names the model in an error."""
    left: list[fx.Node] = []  # the views whose readers now rebuild them, and the copies
    for s in range(len(starts) - 1):
        later = [n for n, k in seg_of.items() if k > s]
        groups: dict[int, tuple[list[fx.Node], list[fx.Node]]] = {}
        for n in live_values(graph, seg_of, s):
            root = getattr(_alias(n), "root", None)
            writers = _writers(later, root) if root is not None else []
            if writers:
                groups.setdefault(id(root), ([], writers))[0].append(n)
        for members, writers in groups.values():
            if len(members) < 2:
                continue
            found = _joined(members)
            if found is None:
                raise _parted(members, writers[0], starts[s + 1], what)
            for view, chain in found[1].items():
                made = _copied(graph, chain, starts[s + 1])
                seg_of.update((node, s + 1) for node in made.values())
                left += [*chain, *made.values()]
                for user in list(view.users):
                    if seg_of.get(user, 0) > s and user not in made.values():
                        user.replace_input_with(view, made[view])
    _drop_unused(graph, seg_of, left)


def _drop_unused(graph: fx.Graph, seg_of: dict[fx.Node, int], views: list[fx.Node]) -> None:
    """Erase those of ``views`` (view ops :func:`rejoin_views` moved or copied) nothing
    reads any more, last first, so that a chain goes whole."""
    for node in reversed(list(dict.fromkeys(views))):
        if not node.users:
            graph.erase_node(node)
            seg_of.pop(node, None)


def _copied(graph: fx.Graph, chain: list[fx.Node], before: fx.Node) -> dict[fx.Node, fx.Node]:
    """Copies of ``chain`` (each reading the copy of the one before) put ``before``."""
    made: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(before):
        for node in chain:
            made[node] = graph.node_copy(node, lambda a: made.get(a, a))
    return made


def _parted(members: list[fx.Node], writer: fx.Node, start: fx.Node, what: str
            ) -> PlanError:
    names = ", ".join(repr(n.name) for n in members)
    return PlanError(
        f"cannot split {what}: values {names} of its forward cross the cut before "
        f"{str(start.target)!r} as views of one tensor, which {writer.name!r} after the cut "
        "writes in place; a cut passes them on as separate tensors, where one process's views "
        "see the write. Clone the view before the cut (.clone()), take it after the write, or "
        "write out of place (s = s + 1)")

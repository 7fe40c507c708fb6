"""A model that is not an ``nn.Sequential``, cut at its own module boundaries.

The model's top-level ``forward`` is traced with ``torch.fx``, keeping its
*units* whole (its repeated blocks and the modules between them), and cut
before each unit's call into :class:`Segment` objects: the glue before a
unit travels with it, and a segment takes and returns the values still
needed, so a skip connection is forwarded through the segments it crosses.
fx rather than ``torch.export`` keeps the user's modules and runs them
eagerly; a forward that branches on a traced value is a PlanError. See
docs/design.md §2.1.
"""

from __future__ import annotations

import copy
import difflib
import itertools
from collections.abc import Sequence
from typing import Any

import torch.fx as fx
from torch import Tensor, nn
from torch.fx.immutable_collections import immutable_dict, immutable_list

from dreampipe.errors import ConfigError, PlanError
from dreampipe.splitter.eval_graphs import eval_graphs
from dreampipe.splitter.fx_tracer import trace_model
from dreampipe.splitter.hf_hooks import Interpreter
from dreampipe.splitter.in_place import carry, live_values, rejoin_views, written
from dreampipe.splitter.materialise import initialiser
from dreampipe.splitter.placing import fetch, place_attr
from dreampipe.splitter.shape_graphs import ShapeGraphs, Signature, signature

__all__ = ["Segment", "eval_refusal", "segments", "split_bounds", "unit_names"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _builtin(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.nn")


def _holds_blocks(module: nn.Module) -> bool:
    """Whether ``module`` has a container of blocks (not only built-in layers) inside."""
    return any(isinstance(m, _CONTAINERS) and not all(_builtin(c) for c in m.children())
               for m in module.modules())


def unit_names(model: nn.Module) -> list[str]:
    """The FQNs of ``model``'s candidate units, in registration order (see the docstring)."""
    out: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if isinstance(child, _CONTAINERS) or (_holds_blocks(child) and not _builtin(child)):
                visit(f"{fqn}.", child)
            else:
                out.append(fqn)

    visit("", model)
    return out


#: A :class:`Segment`'s own fields (not its units).
_FIELDS = frozenset({"graph", "name", "index", "count", "inputs", "tuple_input", "shapes",
                     "targets", "written", "mutated", "eval_graph", "eval_refused",
                     "initialiser"})


class Segment(nn.Module):
    """The nodes of one unit's segment of the traced graph, and what they read.

    Its units and attributes are registered under their FQNs (so its parameter
    names are the model's own); :meth:`run` executes it against any module that
    holds them under the same names (a stage's :class:`~dreampipe.splitter.chain.Chain`).
    ``index`` of ``count`` says where it is in the model; ``inputs`` names the
    first segment's placeholders (the model's keyword arguments).
    """

    def __init__(self, root: nn.Module, graph: fx.Graph, name: str, index: int,
                 count: int) -> None:
        super().__init__()
        self.graph, self.name = graph, name
        self.index, self.count = index, count
        self.inputs = [n for n in graph.nodes if n.op == "placeholder"]
        #: The first segment of an ``nn.Sequential`` whose input is one tuple: it takes the
        #: tuple's items, or the tuple itself (:mod:`.sequential`).
        self.tuple_input = False
        #: The graphs for other input shapes, when the trace baked the example's in.
        self.shapes: ShapeGraphs | None = None
        self.targets: list[str] = []
        #: The attributes (buffers) its nodes write in place, and the inputs (by position):
        #: a value received from another stage is a leaf of autograd, which an in-place op
        #: may not write, so :meth:`run` writes a copy of it, as one process writes the
        #: non-leaf that stage made.
        bases = written(graph)
        self.written = [str(b.target) for b in bases if b.op == "get_attr"]
        self.mutated = {i for i, n in enumerate(self.inputs) if n in bases}
        #: Its graph traced with the model in eval mode, where the forward's code between
        #: units reads ``self.training`` (None: the same graph); :attr:`eval_refused` says
        #: why an evaluation cannot run here, where that graph does not fit the cuts.
        self.eval_graph: fx.Graph | None = None
        self.eval_refused: str | None = None
        self.initialiser = initialiser(root)
        for node in graph.nodes:
            if node.op in ("call_module", "get_attr") and node.target not in self.targets:
                target = str(node.target)
                self.targets.append(target)
                value = fetch(root, target)
                place_attr(root, target, self, value)

    def __setattr__(self, name: str, value: Any) -> None:
        # its own fields stay plain attributes beside a model's module or buffer of that
        # name (``self.graph``, ``self.inputs``), which :func:`place` registers all the same
        if name in _FIELDS:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def run(self, holder: nn.Module, values: Sequence[Any], sig: Signature | None = None
            ) -> Any:
        """The segment on ``values`` (its placeholders in order), reading from ``holder``;
        ``sig``: the signature of the model's inputs (:meth:`signature`; None: the
        example's)."""
        if not holder.training and self.eval_graph is not None:
            graph = self.eval_graph
        else:
            graph = self.graph if self.shapes is None else self.shapes.graph(self.index, sig)
        values = [v.clone() if i in self.mutated and isinstance(v, Tensor) else v
                  for i, v in enumerate(values)]
        return _plain(_Runner(holder, graph=graph, garbage_collect_values=True).run(
            *values, enable_io_processing=False))

    def at(self, sig: Signature | None) -> Segment:
        """This segment running the graph of inputs of signature ``sig`` alone (a copy
        that shares its modules: a profile of other shapes calls it outside a chain)."""
        if self.shapes is None or sig is None:
            return self
        out = copy.copy(self)
        out.graph, out.shapes = self.shapes.graph(self.index, sig), None
        return out

    def signature(self, values: Sequence[Any]) -> Signature | None:
        """The signature of the first segment's ``values`` if the graph depends on it."""
        return None if self.shapes is None else signature(values)

    def bind(self, args: tuple[Any, ...]) -> list[Any]:
        """The first segment's placeholder values: the model's inputs ``args`` by position,
        or one dict of keyword arguments by name."""
        names = [str(n.target) for n in self.inputs]
        if self.tuple_input and len(args) == 1 and type(args[0]) is tuple:
            args = args[0]
        given = dict(args[0]) if len(args) == 1 and isinstance(args[0], dict) else dict(
            zip(names, args, strict=False))
        if len(args) > len(names) or set(given) - set(names):
            extra = sorted(set(given) - set(names)) or [f"{len(args)} positional inputs"]
            raise ConfigError(
                f"the model's forward takes {', '.join(names)}, not "
                f"{', '.join(map(str, extra))}; give its inputs by position, or as one dict of "
                "its keyword arguments", "example")
        values: list[Any] = []
        for node in self.inputs:
            name = str(node.target)
            if name in given:
                values.append(given[name])
            elif node.args:
                values.append(node.args[0])
            else:
                raise ConfigError(f"the model's forward needs {name!r}, which the input does "
                                  "not give; add it to the input", "example")
        return values

    def forward(self, *args: Any) -> Any:
        """The segment, reading its own units and attributes, on the model's inputs (the
        first) or on the tuple of values the previous segment returned (for the example's
        shapes: a :class:`~dreampipe.splitter.chain.Chain` carries other shapes' signature)."""
        if self.index > 0:
            return self.run(self, args[0])
        values = self.bind(args)
        return self.run(self, values, self.signature(values))


class _Runner(Interpreter):
    """The interpreter, reading units and attributes as :func:`fetch` does."""

    def fetch_attr(self, target: str) -> Any:
        return fetch(self.module, target)


def _plain(value: Any) -> Any:
    """``value`` with fx's immutable dicts and lists (what a graph builds) as plain ones, as
    the model's own forward returns them."""
    if isinstance(value, immutable_dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, immutable_list):
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


def segments(model: nn.Module, units: Sequence[str], example: Any = None
             ) -> list[tuple[str, Segment]]:
    """``model`` traced (:mod:`.tracer`) with ``units`` kept whole, on ``example`` (its
    input, or None) and cut before each unit's call. A trace with the example's shapes
    baked in gives its segments the graphs of other shapes too (:mod:`.shapes`)."""
    what = type(model).__name__
    try:
        graph, baked = trace_model(model, set(units), example)
    except PlanError as exc:
        raise PlanError(f"cannot split {what}: {exc}") from exc
    except Exception as exc:
        raise PlanError(
            f"cannot split {what}: torch.fx cannot trace its forward ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); dreampipe traces the forward "
            "around the model's blocks and keeps each block whole: remove control flow on "
            "tensor values from the code between blocks, or give an nn.Sequential"
        ) from exc
    cut = _cut(graph, units, what)
    out = [(label, Segment(model, g, label, s, len(cut))) for s, (label, g) in enumerate(cut)]
    evals = eval_graphs(model, set(units), example, cut, baked,
                        lambda g: _cut(g, units, what))
    for s, (_, segment) in enumerate(out):
        if isinstance(evals, str):
            segment.eval_refused = f"{what}'s forward {evals}"
        else:
            segment.eval_graph = evals[s]
    if baked:
        first = out[0][1]
        names = [str(n.target) for n in first.inputs]

        def retrace(values: list[Any]) -> list[tuple[str, fx.Graph]]:
            given = dict(zip(names, values, strict=True))
            again = ({k: given[k] for k in example} if isinstance(example, dict) else
                     tuple(values[: len(example)]) if isinstance(example, tuple) else values[0])
            return _cut(trace_model(model, set(units), again, shapes_known=True,
                                    again=True)[0], units, what)

        traced = signature(first.bind(example if isinstance(example, tuple) else (example,)))
        shapes = ShapeGraphs(retrace, traced, cut)
        for _, segment in out:
            segment.shapes = shapes
    return out


def eval_refusal(layers: Sequence[tuple[str, nn.Module]]) -> str | None:
    """Why a model of ``layers`` cannot be evaluated in eval mode (:mod:`.eval_graphs`);
    None where it can."""
    return next((m.eval_refused for _, m in layers
                 if isinstance(m, Segment) and m.eval_refused), None)


def _cut(graph: fx.Graph, units: Sequence[str], what: str) -> list[tuple[str, fx.Graph]]:
    """``graph`` cut before each call of a unit: each segment's label and graph."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    calls = [i for i, n in enumerate(nodes) if n.op == "call_module" and n.target in units]
    if not calls:
        raise PlanError(f"cannot split {what}: its forward calls none of its submodules")
    bounds = [0, *calls[1:], len(nodes)]
    seg_of = {n: s for s, (a, b) in enumerate(itertools.pairwise(bounds)) for n in nodes[a:b]}
    for n in graph.nodes:
        if n.op == "placeholder":
            seg_of[n] = 0
    output = next(n for n in graph.nodes if n.op == "output")
    seg_of[output] = len(calls)
    rejoin_views(graph, seg_of, [nodes[c] for c in calls], what)
    groups = [[n for n in graph.nodes if seg_of.get(n) == s and n.op != "placeholder"]
              for s in range(len(calls))]
    live = [live_values(graph, seg_of, s) for s in range(len(calls))]
    out: list[tuple[str, fx.Graph]] = []
    seen: dict[str, int] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for s, group in enumerate(groups):
        g = _segment_graph(placeholders if s == 0 else live[s - 1], s == 0, group,
                           output if s == len(groups) - 1 else live[s])
        name = str(nodes[calls[s]].target)
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f"{name}@{seen[name]}", g))
    return out


def _segment_graph(inputs: list[fx.Node], first: bool, group: list[fx.Node],
                   result: fx.Node | list[fx.Node]) -> fx.Graph:
    """A graph of ``group`` taking ``inputs`` (the model's placeholders when ``first``) and
    returning ``result``: the model's output node, or the values to pass on."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        env[n] = g.node_copy(n) if first else g.placeholder(f"in_{i}_{n.name}")
        carry(n, env[n])

    def copy(n: fx.Node) -> None:
        for arg in n.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = g.node_copy(arg)
        if n.op != "output":
            env[n] = g.node_copy(n, env.__getitem__)

    for n in group:
        copy(n)
    if isinstance(result, fx.Node):
        copy(result)
        g.output(fx.map_arg(result.args[0], env.__getitem__))
    else:
        g.output(tuple(env[n] for n in result))
    return g


def split_bounds(names: Sequence[str], split_points: Sequence[str], model: nn.Module) -> list[int]:
    """The first layer of each stage: layer 0, then the first unit at or under each split
    point, in order; a ConfigError naming a point that begins no unit, and the nearest that
    do."""
    bounds = [0]
    for point in split_points:
        hit = next((i for i, n in enumerate(names)
                    if n == point or n.startswith(f"{point}.")), None)
        if hit is None or hit == 0:
            raise ConfigError(_bad_point(point, names, model, first=hit == 0), "plan")
        if hit <= bounds[-1]:
            raise ConfigError(
                f"split point {point!r} (layer {hit}) does not come after the previous one "
                f"({names[bounds[-1]]!r}); give split points in call order, each once",
                "plan")
        bounds.append(hit)
    return bounds


def _bad_point(point: str, names: Sequence[str], model: nn.Module, *, first: bool) -> str:
    if first:
        return (f"split point {point!r} begins the first stage, which needs no split point; "
                f"name where the second stage begins, e.g. {names[1]!r}" if len(names) > 1
                else f"split point {point!r}: the model has one unit, nothing to split")
    inside = next((n for n in names if point.startswith(f"{n}.")), None)
    if inside is not None:
        i = names.index(inside)
        near = [n for n in (names[i], names[i + 1] if i + 1 < len(names) else None) if n]
        return (f"split point {point!r} is inside {inside!r}, a "
                f"{type(model.get_submodule(inside.split('@')[0])).__name__} that runs whole on "
                f"one stage; split at {' or '.join(repr(n) for n in near)}")
    try:
        model.get_submodule(point)
        reason = "names a module the forward does not call"
    except AttributeError:
        reason = "names no module of the model"
    near = difflib.get_close_matches(point, list(names), n=2, cutoff=0.0)
    return (f"split point {point!r} {reason}; the nearest valid split points are "
            f"{', '.join(repr(n) for n in near)}")

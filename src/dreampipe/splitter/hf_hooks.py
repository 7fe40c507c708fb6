"""Hugging Face's output-capturing hooks inside units, through a trace.

A unit is one node of the trace, so Hugging Face's forward hooks inside it
(router logits, hidden states, attentions) never fire on traced values; the
trace calls each hook (:func:`replay`) on stand-ins of what its module takes
and returns, built from the unit's run on ``meta`` (:func:`recording`), and
an item the hook reads becomes an output of the unit's node, which
:class:`Interpreter` takes from the module at run time. A run that differs
from what the trace assumed is a PlanError naming the flags to turn off.
See docs/design.md §2.1.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch import Tensor, nn

from dreampipe.errors import PlanError

__all__ = ["CAPTURE", "Capture", "Firings", "Interpreter", "prune", "recording", "replay"]

#: Modules whose forward hooks collect outputs for the model's forward.
_CAPTURING_HOOK_MODULES = ("transformers.utils.output_capturing",)
#: The ``node.meta`` key of a unit's :class:`Capture`.
CAPTURE = "dreampipe_capture"
_FIX = ("turn that output off (output_router_logits=False, output_hidden_states=False, "
        "output_attentions=False) or compute it outside the model")
#: A forward hook: (its module's FQN in the unit, the module, its key there, the hook).
Hook = tuple[str, nn.Module, int, Callable[..., Any]]
#: Not known: the meta run did not reach it.
_UNKNOWN = object()


@dataclass(frozen=True)
class Capture:
    """What a unit's node takes from its hooked modules at run time: their FQNs in the
    order they run, and each read item's run (an index into those) and path in its
    ``(args, output)``."""

    fqns: tuple[str, ...]
    reads: tuple[tuple[int, tuple[Any, ...]], ...]


@dataclass
class Firings:
    """A unit's meta run: the hooks inside it that fired, with their ``(args, output)``,
    and whether it finished."""

    fired: list[tuple[Hook, tuple[Any, Any]]] = field(default_factory=list)
    complete: bool = False


def _hooks(unit: nn.Module) -> list[Hook]:
    """The output-capturing forward hooks of ``unit`` and its submodules."""
    return [(fqn, m, k, hook) for fqn, m in unit.named_modules(remove_duplicate=False)
            for k, hook in m._forward_hooks.items()
            if k not in m._forward_hooks_with_kwargs
            and getattr(hook, "__module__", None) in _CAPTURING_HOOK_MODULES]


@contextlib.contextmanager
def recording(unit: nn.Module) -> Iterator[Firings]:
    """While ``unit`` runs on meta, the capturing hooks inside it note what they are
    given instead of running; its own do nothing (:func:`replay` calls them)."""
    firings = Firings()
    hooks = _hooks(unit)

    def note(hook: Hook, module: nn.Module, args: Any, out: Any) -> None:
        if hook[0]:
            firings.fired.append((hook, (args, out)))

    for hook in hooks:
        hook[1]._forward_hooks[hook[2]] = functools.partial(note, hook)
    try:
        yield firings
        firings.complete = True
    finally:
        for _, m, k, fn in hooks:
            m._forward_hooks[k] = fn


class _Reads:
    """The items the hooks read, each an output of the unit's node ``out``."""

    def __init__(self, out: fx.Proxy, value: Callable[[fx.Proxy, Any], Any]) -> None:
        self.out, self.value = out, value
        self.own = value(out, None)
        self.reads: list[tuple[int, tuple[Any, ...]]] = []
        self.values: list[Any] = []
        self.proxies: dict[tuple[int, tuple[Any, ...]], fx.Proxy] = {}

    def read(self, run: int, path: tuple[Any, ...], value: Any) -> fx.Proxy:
        if (run, path) not in self.proxies:
            self.reads.append((run, path))
            self.values.append(value)
            self.value(self.out, (self.own, *self.values))
            self.proxies[run, path] = self.out[len(self.reads)]  # type: ignore[index]
        return self.proxies[run, path]

    def stand_in(self, run: int, path: tuple[Any, ...], value: Any, what: str) -> Any:
        """``value`` (a tuple, a tensor, a constant, or :data:`_UNKNOWN`) with its tensors
        read on use."""
        if isinstance(value, Tensor):
            return self.read(run, path, value)
        if type(value) is tuple or value is _UNKNOWN:
            return _Items(self, run, path, value, what)
        return value


class _Items(tuple):  # type: ignore[type-arg]
    """A tuple whose items are read on use; of unknown length if its value is not known."""

    _reads: _Reads
    _at: tuple[int, tuple[Any, ...]]
    _value: Any
    _what: str

    def __new__(cls, reads: _Reads, run: int, path: tuple[Any, ...], value: Any,
                what: str) -> _Items:
        self = super().__new__(cls, () if value is _UNKNOWN else value)
        self._reads, self._at, self._value, self._what = reads, (run, path), value, what
        return self

    def __getitem__(self, i: Any) -> Any:
        (run, path), value = self._at, self._value
        if not isinstance(i, int):
            raise PlanError(f"a hook reads {self._what}[{i!r}], which dreampipe cannot "
                            f"record; {_FIX}")
        if value is _UNKNOWN:  # an item of a tuple not known: read whole
            return self._reads.read(run, (*path, i), _UNKNOWN)
        return self._reads.stand_in(run, (*path, i), value[i], f"{self._what}[{i}]")

    def __len__(self) -> int:
        if self._value is _UNKNOWN:
            raise PlanError(f"a hook needs the length of {self._what}, which the block's run "
                            f"on the meta device did not reach; {_FIX}")
        return len(self._value)

    def __iter__(self) -> Iterator[Any]:
        return iter([self[i] for i in range(len(self))])


def replay(unit: nn.Module, name: str, out: fx.Proxy, args: tuple[Any, ...],
           firings: Firings, value: Callable[[fx.Proxy, Any], Any]) -> fx.Proxy:
    """Call the capturing hooks of ``unit`` (at FQN ``name``, its node ``out``) on
    stand-ins (see the docstring); the unit's output. ``value(proxy, v)`` reads a
    proxy's meta value (``v`` not None: sets it)."""
    hooks = _hooks(unit)
    if not hooks:
        return out
    runs = [(hook, given) for hook, given in firings.fired]
    if not firings.complete:  # the rest: once each, after those reached
        reached = {(h[0], h[2]) for h, _ in runs}
        runs += [(h, (_UNKNOWN, _UNKNOWN)) for h in hooks if h[0] and (h[0], h[2]) not in reached]
    reads = _Reads(out, value)
    for run, ((fqn, module, _, fn), (a, o)) in enumerate(runs):
        what = f"what {type(module).__name__} {name}.{fqn}"
        fn(module, reads.stand_in(run, (0,), a, f"{what} gets"),
           reads.stand_in(run, (1,), o, f"{what} returns"))
    result = out
    if reads.reads:
        hooked = {runs[run][0][0] for run, _ in reads.reads}
        kept = [run for run, (h, _) in enumerate(runs) if h[0] in hooked]
        out.node.meta[CAPTURE] = Capture(tuple(runs[r][0][0] for r in kept), tuple(
            (kept.index(run), path) for run, path in reads.reads))
        result = out[0]  # type: ignore[index]
    own = reads.own
    for _, module, _, fn in (h for h in hooks if not h[0]):
        fn(module, args, tuple(result[i] for i in range(len(own)))  # type: ignore[index]
           if type(own) is tuple else result)
    return result


def prune(graph: fx.Graph) -> None:
    """Drop the captures of the units' nodes whose read items nothing uses (a hook that
    was handed a tensor and did not keep it)."""
    for node in list(graph.nodes):
        if CAPTURE not in node.meta or any(u.args[1] != 0 and u.users for u in node.users):
            continue
        for u in list(node.users):
            if u.args[1] == 0:
                u.replace_all_uses_with(node)
            graph.erase_node(u)
        del node.meta[CAPTURE]


def _note(got: list[tuple[str, Any]], fqn: str, module: nn.Module, args: Any, out: Any
          ) -> None:
    got.append((fqn, (args, out)))


class Interpreter(fx.Interpreter):
    """fx's interpreter; a unit's node with a :class:`Capture` also returns the items
    it reads from its hooked modules."""

    def run_node(self, n: fx.Node) -> Any:
        capture: Capture | None = n.meta.get(CAPTURE)
        if capture is None:
            return super().run_node(n)
        unit = self.fetch_attr(str(n.target))
        got: list[tuple[str, Any]] = []
        handles = [unit.get_submodule(fqn).register_forward_hook(functools.partial(
            _note, got, fqn)) for fqn in dict.fromkeys(capture.fqns)]
        try:
            out = super().run_node(n)
        finally:
            for handle in handles:
                handle.remove()
        fqns = tuple(fqn for fqn, _ in got)
        if fqns != capture.fqns:
            raise PlanError(
                f"the modules inside {n.target!r} whose outputs Hugging Face's hooks collect "
                f"ran as {list(fqns)}, not as traced ({list(capture.fqns)}); {_FIX}")
        return (out, *(_item(got[run][1], path, f"{n.target}.{got[run][0]}")
                       for run, path in capture.reads))


def _item(given: Any, path: tuple[Any, ...], module: str) -> Any:
    """The item at ``path`` of what ``module`` got and returned, as the trace took it: in
    tuples, and not None (a None the trace knew was not read)."""
    for depth, i in enumerate(path):
        if depth and type(given) not in (tuple, list):
            raise PlanError(f"{module} returned a {type(given).__name__} where the trace took "
                            f"a tuple, as Hugging Face's hook reads it; {_FIX}")
        given = given[i]
    if given is None:
        raise PlanError(f"{module} returned None where the trace, which could not run it on "
                        f"the meta device, took a value that Hugging Face's hook collects; {_FIX}")
    return given

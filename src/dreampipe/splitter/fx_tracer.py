"""torch.fx tracing of a model's forward around its units.

Every trace keeps each *unit* (an FQN) whole as one ``call_module`` node,
keeps configs as constants and rebuilds ``ModelOutput``, runs Hugging Face's
mask builders and MoE auxiliary losses whole at run time, replays
output-capturing hooks (:mod:`.hooks`), traces a ``**kwargs`` forward under
the example's argument names with ``use_cache=False``, and knows each node's
value on the ``meta`` device. A plain trace (symbolic shapes) is tried
first; when code branches on shapes, the second reads the meta values as
concrete and bakes the example's shapes in (:mod:`.shapes`). A forward that
branches on tensor values fails both, and the caller says so. See
docs/design.md §2.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils import _pytree as pytree

from dreampipe.splitter.hf_hooks import Firings, prune, recording, replay
from dreampipe.splitter.in_place import IN_PLACE_OPERATORS, note, versions
from dreampipe.splitter.trace_effects import undone

__all__ = ["call_on_meta", "on_meta", "trace_model"]

_log = logging.getLogger(__name__)

#: Modules whose functions run whole at run time (they branch on tensor values).
_LEAF_FUNCTION_MODULES = ("transformers.masking_utils",)
#: Functions of Hugging Face's models that run whole at run time: MoE auxiliary losses
#: branch on the device of the router logits, which a trace on ``meta`` does not know.
_LEAF_FUNCTION_NAMES = ("load_balancing_loss_func", "router_z_loss_func")
_CONCRETE = ("shape", "dtype", "ndim", "layout", "size", "dim", "numel", "is_floating_point")
_VALUE = "_dreampipe_value"
#: The meta value of a proxy whose value is not known (it fails whatever reads it).
_UNKNOWN = object()


def _is_proxy(a: Any) -> bool:
    return isinstance(a, fx.Proxy)


def _has_proxy(tree: Any) -> bool:
    return any(_is_proxy(x) for x in pytree.tree_leaves(tree, is_leaf=_is_proxy))


def _value(a: Any) -> Any:
    """The meta value behind a proxy (:data:`_UNKNOWN` if not known), or ``a`` itself."""
    if isinstance(a, fx.proxy.Attribute):
        root = _value(a.root)
        return _UNKNOWN if root is _UNKNOWN else getattr(root, a.attr, _UNKNOWN)
    if _is_proxy(a):
        return a.__dict__.get(_VALUE, _UNKNOWN)
    return a


class _MetaProxy(fx.Proxy):
    """A proxy that knows its meta value. A tensor's has only the attributes a tensor
    has (a duck-typing probe, ``hasattr(x, "jax")``, is False as it is at run time);
    in a concrete trace, shapes and Python values are concrete too."""

    def _known(self) -> Any:
        """The meta value, if the trace may use it as concrete (else :data:`_UNKNOWN`)."""
        tracer = self.tracer
        return self.__dict__.get(_VALUE, _UNKNOWN) if isinstance(tracer, _Tracer) and (
            tracer.concrete) else _UNKNOWN

    def __getattr__(self, k: str) -> Any:
        value = self.__dict__.get(_VALUE)
        if isinstance(value, Tensor) and self.node.op != "get_attr" and not hasattr(
                type(value), k):
            raise AttributeError(f"{type(value).__name__!r} object has no attribute {k!r}")
        if isinstance(self._known(), Tensor) and k in _CONCRETE:
            return getattr(value, k)
        return super().__getattr__(k)

    def __len__(self) -> int:
        value = self._known()
        if isinstance(value, (tuple, list, Tensor)):
            return len(value)
        return super().__len__()

    def __iter__(self) -> Iterator[Any]:
        value = self._known()
        if isinstance(value, (tuple, list)):
            return iter([self[i] for i in range(len(value))])  # type: ignore[index]
        return super().__iter__()

    def __bool__(self) -> bool:
        value = self._known()
        if isinstance(value, (bool, int, float, str, type(None))):
            return bool(value)
        return super().__bool__()

    def __setitem__(self, key: Any, value: Any) -> None:
        """Item assignment (``ids[..., 0] = start``) is a node, run in place in its turn."""
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


def _in_place(op: Callable[[Any, Any], Any]) -> Callable[[fx.Proxy, Any], fx.Proxy]:
    def method(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


for _name, _op in IN_PLACE_OPERATORS.items():  # ``h += s`` writes h, as the forward does
    setattr(_MetaProxy, _name, _in_place(_op))


class _Tracer(fx.Tracer):
    """Units kept whole, every node's meta value alongside (from ``inputs``, the meta
    values of the forward's arguments by name; None: none known); ``concrete``: shapes
    and Python values read as the example's (else they stay symbolic)."""

    def __init__(self, units: set[str], inputs: dict[str, Any] | None, concrete: bool) -> None:
        super().__init__()
        self.proxy_buffer_attributes = True  # a buffer the forward updates is in the graph
        self.units = units
        self.inputs = inputs
        self.concrete = concrete
        self._eager = False
        self._firings: Firings | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.units or (
            super().is_leaf_module(m, module_qualified_name)
            and not any(u.startswith(f"{module_qualified_name}.") for u in self.units))

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        if self._eager:
            return forward(*args, **kwargs)
        try:
            path = self.path_of_module(m)
        except NameError:  # made by the forward (``CrossEntropyLoss()``): traced through
            return forward(*args, **kwargs)
        self._firings = None
        out = super().call_module(m, forward, args, kwargs)
        if not self.is_leaf_module(m, path) or not isinstance(out, fx.Proxy):
            return out
        return replay(m, path, out, args, self._firings or Firings(), self._meta)

    @staticmethod
    def _meta(p: fx.Proxy, value: Any) -> Any:
        """``p``'s meta value; ``value`` not None: set it."""
        if value is None:
            return _value(p)
        p.__dict__[_VALUE] = value
        return value

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if self._eager:  # a unit running on meta for its value: its reads are not nodes
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _MetaProxy(node, self)

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, dict) and type(a) is not dict and _has_proxy(dict(a)):
            # a ModelOutput: rebuilt as itself from its (non-None) items at run time
            return self.create_node("call_function", type(a), (),
                                    {k: self.create_arg(v) for k, v in a.items()})
        if dataclasses.is_dataclass(a) and not isinstance(a, type) and not _has_proxy(
                [getattr(a, f.name) for f in dataclasses.fields(a)]):
            return a
        try:
            return super().create_arg(a)
        except NotImplementedError:  # a value fx has no argument form for: kept as it is
            return a

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any], *rest: Any, **kw: Any) -> fx.Proxy:
        if kind == "placeholder" and any(isinstance(a, Tensor) for a in pytree.tree_leaves(args)):
            # a default tensor (``y=torch.zeros(4, 8)``) stays the placeholder's value, not a
            # get_attr of a constant fx would store on the model, which a segment lacks
            p = super().create_proxy(kind, target, (), kwargs, *rest, **kw)
            p.node.args = args
        else:
            p = super().create_proxy(kind, target, args, kwargs, *rest, **kw)
        if self.inputs is None:
            return p
        try:
            metas = pytree.tree_map(_value, (args, kwargs), is_leaf=_is_proxy)
            before = versions(metas)
            value = self._meta_value(kind, target, *metas)
        except Exception:  # unknown: only what reads it fails the trace
            value = _UNKNOWN
        else:
            note(p.node, value, metas, before)
        p.__dict__[_VALUE] = value
        return p

    def _meta_value(self, kind: str, target: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        if kind == "placeholder":
            value = (self.inputs or {}).get(target, args[0] if args else _UNKNOWN)
            return pytree.tree_map_only(Tensor, on_meta, value)
        if kind == "get_attr":
            value = _attribute(self.root, str(target))
            return on_meta(value) if isinstance(value, Tensor) else value
        if kind == "call_function":
            if inspect.isfunction(target) and _runs_whole(target):
                return _on_fake(target, args, kwargs)
            return target(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        if kind == "call_module":
            module = self.root.get_submodule(str(target))
            self._eager = True
            try:
                with recording(module) as self._firings:
                    return call_on_meta(module, args, kwargs)
            finally:
                self._eager = False
        return None


def _attribute(root: nn.Module, target: str) -> Any:
    """``root``'s attribute ``target`` (an FQN) as stored, not through ``nn.Module``'s
    ``__getattr__``, which the tracer patches to hand out proxies."""
    *path, name = target.split(".")
    module = root
    for part in path:
        module = module._modules[part]  # type: ignore[assignment]
    for store in (module._parameters, module._buffers, module.__dict__):
        if name in store:
            return store[name]
    return getattr(module, name)


def on_meta(t: Tensor) -> Tensor:
    """``t``'s shape and dtype on the ``meta`` device: no memory, no compute."""
    return torch.empty_like(t, device="meta")


def call_on_meta(module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any] | None = None, *,
                 written: set[str] | None = None) -> Any:
    """``module(*args, **kwargs)`` with its parameters and buffers on ``meta``: what it
    returns, shapes only (the module itself is left as it is); ``written`` gets the names
    of the buffers the call wrote in place (their version moved)."""
    tensors = {k: on_meta(v) for k, v in (*module.named_parameters(), *module.named_buffers())}
    versions = {k: tensors[k]._version for k, _ in module.named_buffers()}
    # functional_call puts its tensors back by name; a submodule held under two names
    # would keep the meta stand-ins (torch's tie_weights), so every slot is put back here
    slots = [(m, dict(m._parameters), dict(m._buffers)) for m in module.modules()]
    try:
        out = functional_call(module, tensors, args, kwargs)
    finally:
        for m, params, buffers in slots:
            m._parameters.update(params)
            m._buffers.update(buffers)
    if written is not None:
        written.update(k for k, v in versions.items() if tensors[k]._version != v)
    return out


def _on_fake(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn``'s meta value from fake tensors, which Hugging Face's mask builders take as
    traced (they skip the branches on values that meta tensors cannot answer)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        out = fn(*pytree.tree_map_only(Tensor, mode.from_tensor, args),
                 **pytree.tree_map_only(Tensor, mode.from_tensor, kwargs))
    return pytree.tree_map_only(
        Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), out)


def _leaf_function(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def call(*args: Any, **kwargs: Any) -> Any:
        proxies = [a for a in pytree.tree_leaves((args, kwargs), is_leaf=_is_proxy)
                   if _is_proxy(a)]
        if not proxies:
            return orig(*args, **kwargs)
        return proxies[0].tracer.create_proxy("call_function", orig, args, kwargs)

    return call


def _runs_whole(fn: Callable[..., Any]) -> bool:
    module = fn.__module__ or ""
    return module in _LEAF_FUNCTION_MODULES or (
        module.startswith("transformers.") and fn.__name__ in _LEAF_FUNCTION_NAMES)


@contextlib.contextmanager
def _leaf_functions(model: nn.Module) -> Iterator[None]:
    """Replace, in the globals of every module's forward, the functions that run whole
    (:data:`_LEAF_FUNCTION_MODULES`, :data:`_LEAF_FUNCTION_NAMES`) by ones that record a
    single call."""
    patched: list[tuple[dict[str, Any], str, Any]] = []
    for module in model.modules():
        scope = inspect.unwrap(type(module).forward).__globals__
        for name, value in list(scope.items()):
            if (inspect.isfunction(value) and _runs_whole(value)
                    and not any(p[0] is scope and p[1] == name for p in patched)):
                patched.append((scope, name, value))
                scope[name] = _leaf_function(value)
    try:
        yield
    finally:
        for scope, name, value in reversed(patched):
            scope[name] = value


@contextlib.contextmanager
def _named_forward(model: nn.Module, names: list[str]) -> Iterator[None]:
    """Give ``model`` (for the trace) a forward of exactly ``names``, calling its own with
    them as keyword arguments (and ``use_cache=False`` when it takes ``use_cache``)."""
    own = type(model).forward
    fixed = {"use_cache": False} if "use_cache" in inspect.signature(own).parameters else {}
    src = (f"def forward(self, {', '.join(names)}):\n"
           f"    return _own(self, {', '.join(f'{n}={n}' for n in names)}, **_fixed)\n")
    scope: dict[str, Any] = {"_own": own, "_fixed": fixed}
    exec(src, scope)  # a forward with the example's argument names
    cls = model.__class__
    model.__class__ = type(cls.__name__, (cls,), {"forward": scope["forward"]})
    try:
        yield
    finally:
        model.__class__ = cls


def trace_model(model: nn.Module, units: set[str], example: Any, *,
                shapes_known: bool = False, again: bool = False) -> tuple[fx.Graph, bool]:
    """``model``'s forward as a graph with ``units`` kept whole, and whether the example's
    shapes are baked into it; ``example`` is its input (a tensor, a tuple, a dict of keyword
    arguments, or None: no shapes known).

    A plain fx trace first, which keeps shapes symbolic (a smaller last batch still
    runs); if that fails, or at once with ``shapes_known``, a trace with the example's
    shapes known (see the docstring). What the trace did to the model is undone
    (:mod:`.trace_effects`), said once: not ``again``."""
    own = inspect.signature(type(model).forward).parameters
    plain = not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in own.values())
    if isinstance(example, dict):
        names = list(example)
    elif plain or example is None:
        names = [n for n in own if n != "self"]
    else:
        names = [n for n in own if n != "self"][: len(example) if isinstance(example, tuple)
                                                  else 1]
    values = list(example.values()) if isinstance(example, dict) else (
        list(example) if isinstance(example, tuple) else [example])
    inputs = {n: on_meta(v) if isinstance(v, Tensor) else v
              for n, v in zip(names, values, strict=False)}
    rename = isinstance(example, dict) or not plain

    def trace(concrete: bool) -> fx.Graph:
        named = _named_forward(model, names) if rename else contextlib.nullcontext()
        with undone(model, warn=not again), named, _leaf_functions(model):
            graph = _Tracer(units, None if example is None else inputs, concrete).trace(model)
        prune(graph)
        return graph

    if example is None:
        return trace(False), False
    if not shapes_known:
        try:
            return trace(False), False
        except Exception as exc:
            _log.debug("plain fx trace failed (%s); tracing with the example's shapes", exc)
    return trace(True), True

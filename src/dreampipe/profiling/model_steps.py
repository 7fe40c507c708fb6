"""A model as a list of executable steps: what the profiler calls a layer.

- ``nn.Sequential``: each child module is a step; they form a chain.
- any other module: traced with ``torch.fx``; each ``call_module``,
  ``call_function`` and ``call_method`` node is a step that may be a layer,
  except indexing (``getitem``/``getattr``), which is glue. A step reads the
  values of its ``deps`` by node name, so the traced data flow (a residual
  ``x + f(x)`` included) is kept.
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dreampipe.errors import ProfileError

__all__ = ["INPUT", "Env", "Step", "model_steps"]

Env = dict[str, Any]
INPUT = "__input__"
_GLUE_FUNCTIONS = (operator.getitem, builtins.getattr)


@dataclass
class Step:
    """One executable node: reads ``deps`` from the environment, writes ``key``."""

    key: str
    deps: tuple[str, ...]
    run: Callable[[Env], Any]
    name: str
    description: str
    params: tuple[nn.Parameter, ...]
    may_be_layer: bool


def model_steps(model: nn.Module) -> tuple[list[Step], str]:
    """The steps of ``model`` in execution order, and the key of its output."""
    if isinstance(model, nn.Sequential):
        return _sequential_steps(model)
    return _fx_steps(model)


def _sequential_steps(model: nn.Sequential) -> tuple[list[Step], str]:
    children = list(model._modules.items())
    if not children:
        raise ProfileError("the nn.Sequential has no layers; give it at least one child module")
    steps: list[Step] = []
    prev = INPUT
    for child_name, child in children:
        steps.append(Step(
            key=child_name, deps=(prev,), run=_call_child(child, prev), name=child_name,
            description=_describe_module(child), params=tuple(child.parameters()),
            may_be_layer=True,
        ))
        prev = child_name
    return steps, prev


def _call_child(child: nn.Module, dep: str) -> Callable[[Env], Any]:
    return lambda env: child(env[dep])


def _fx_steps(model: nn.Module) -> tuple[list[Step], str]:
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception as exc:
        raise ProfileError(
            f"cannot trace {type(model).__name__} with torch.fx ({type(exc).__name__}: {exc}); "
            "wrap its layers in an nn.Sequential or remove data-dependent control flow"
        ) from exc
    steps: list[Step] = []
    output_key = ""
    names: set[str] = set()
    placeholders = 0
    for node in gm.graph.nodes:
        deps = tuple(n.name for n in node.all_input_nodes)
        if node.op == "placeholder":
            placeholders += 1
            if placeholders > 1 and not node.args:
                raise ProfileError(
                    f"{type(model).__name__}.forward takes a second input {node.target!r}; "
                    "the profiler feeds one sample input: give it a default or pack the inputs"
                )
            steps.append(_glue(node.name, deps, _placeholder(placeholders, node.args)))
        elif node.op == "get_attr":
            steps.append(_glue(node.name, deps, _constant(_fetch_attr(gm, str(node.target)))))
        elif node.op == "output":
            output_key = node.name
            steps.append(_glue(node.name, deps, _node_runner(gm, node)))
        else:
            steps.append(_fx_layer(gm, node, deps, names))
    return steps, output_key


def _fx_layer(gm: torch.fx.GraphModule, node: torch.fx.Node, deps: tuple[str, ...],
              names: set[str]) -> Step:
    params: tuple[nn.Parameter, ...] = ()
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        label, description = str(node.target), _describe_module(module)
        params = tuple(module.parameters())
    elif node.op == "call_method":
        label, description = node.name, f"Tensor.{node.target}"
    else:
        label = node.name
        description = getattr(node.target, "__name__", str(node.target))
    unique, k = label, 1
    while unique in names:
        unique, k = f"{label}#{k}", k + 1
    names.add(unique)
    glue = node.op == "call_function" and node.target in _GLUE_FUNCTIONS
    return Step(node.name, deps, _node_runner(gm, node), unique, description, params, not glue)


def _glue(key: str, deps: tuple[str, ...], run: Callable[[Env], Any]) -> Step:
    return Step(key, deps, run, key, "", (), may_be_layer=False)


def _placeholder(position: int, defaults: tuple[Any, ...]) -> Callable[[Env], Any]:
    if position == 1:
        return lambda env: env[INPUT]
    return lambda env: defaults[0]


def _constant(value: Any) -> Callable[[Env], Any]:
    return lambda env: value


def _fetch_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _node_runner(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Callable[[Env], Any]:
    """Execute one fx node on values looked up by node name (as ``torch.fx.Interpreter``)."""

    def run(env: Env) -> Any:
        args: Any = torch.fx.node.map_arg(node.args, lambda n: env[n.name])
        kwargs: Any = torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        if node.op == "call_module":
            return gm.get_submodule(str(node.target))(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        if node.op == "output":
            return args[0]
        target: Callable[..., Any] = node.target  # type: ignore[assignment]
        return target(*args, **kwargs)

    return run


def _describe_module(module: nn.Module) -> str:
    """``Conv2d(1, 16, ...)`` for a leaf, the children joined by ``+`` for a Sequential."""
    if isinstance(module, nn.Sequential):
        return " + ".join(_describe_module(child) for child in module.children())
    if any(True for _ in module.children()):
        return type(module).__name__
    extra = " ".join(module.extra_repr().split())
    return f"{type(module).__name__}({extra})"

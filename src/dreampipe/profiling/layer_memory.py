"""What a stage holds besides its layers' kept tensors, per layer (docs/design.md §5.4).

- :func:`backward_bytes`: the most a layer's backward holds at once (its upstream gradient
  and what it makes, counted by storage as ops make and drop them), the loss's backward
  on the last layer: fp32 whatever the formats, as cross-entropy upcasts 16-bit logits.
- :func:`deferred_bytes`: what stays alive until a stage's backward ends while the runtime
  defers its Linear weight gradients (:mod:`dreampipe.runtime.fused`, after the first
  stage): each Linear's output gradient, and its input where not the layer's own.
- :func:`recorded_bytes`: what a split backward's ``B`` keeps for ``W``: the gradients
  of the outputs of the modules that hold weights.
- :func:`library_bytes`: the anonymous memory a process keeps after a layer first runs,
  cold and as the runtime runs it, twice (a weight GEMM, then one adding into it): on
  CPU, oneDNN's cached 16-bit primitives and their buffers, for the life of the process.
  16-bit formats on Linux CPU only (``/proc``): fp32 GEMMs fill the BLAS's process-wide
  buffers, which a rank fills before its baseline as it measures the machine. Layers of
  one kind (``Layer.kernel_kind``) share their kind's largest reading (:func:`with_library`).
- :func:`sent_bytes`: an output as it crosses stages (under autocast, in its dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dreampipe.profiling.graph import Layer
from dreampipe.profiling.heap import glibc
from dreampipe.profiling.model_steps import INPUT, Env, Step
from dreampipe.profiling.tensor_bytes import TensorBytes
from dreampipe.profiling.tensor_trees import detach, fresh, storages, tensors

__all__ = [
    "OUTPUTS",
    "backward_bytes",
    "deferred_bytes",
    "library_bytes",
    "linear_operands",
    "new_parameter_bytes",
    "recorded_bytes",
    "sent_bytes",
    "with_library",
]

_STATUS = Path("/proc/self/status")

#: The key suffix under which :func:`linear_operands` notes a layer's Linear outputs.
OUTPUTS = "/outputs"

#: The loss of the model's output: ``loss(output)``, the target bound.
Loss = Callable[[Any], Tensor]


def backward_bytes(layers: Sequence[Step], env: Env, grads: dict[str, list[Tensor | None]],
                   loss: Loss) -> list[int]:
    """Each layer's :attr:`~dreampipe.profiling.graph.Layer.backward_bytes`: its backward
    to fresh leaves of its inputs with the recorded upstream gradient (the last layer's
    through ``loss``), the most it holds beyond what the forward kept, as it makes
    tensors and frees them and the kept ones (counted from the forward on), plus that
    gradient; not its weight gradients, which the update's buffers hold (the stage's
    ``+ 1`` weights)."""
    out = []
    for i, step in enumerate(layers):
        given = list(tensors([env[d] for d in step.deps]))
        live = TensorBytes(given[0].device.type if given else "cpu")
        leaves: list[Tensor] = []
        with live.counting():  # the forward's kept tensors count, and so do their frees
            value = step.run({d: fresh(env[d], leaves) for d in step.deps})
            # weight gradients go to the update's buffers, counted apart (unless nothing
            # else carries the backward: a first layer of token ids)
            wrt = leaves or [p for p in _params(step, env) if p.requires_grad]
            if i == len(layers) - 1:
                outs, upstream, incoming = [loss(value)], None, 0
            else:
                pairs = [(o, g) for o, g in zip(tensors(value), grads[step.key], strict=False)
                         if g is not None and o.requires_grad]
                outs, upstream = [o for o, _ in pairs], [g for _, g in pairs]
                incoming = sum(storages(upstream).values())
            del value
            live.reset_peak()
            kept = live.now
            if outs and wrt and outs[0].requires_grad:
                torch.autograd.grad(outs, wrt, upstream, allow_unused=True)
        del outs
        live.close()
        out.append(live.peak - kept + incoming)
    return out


@contextmanager
def linear_operands(model: nn.Module, layers: Sequence[Step],
                    running: Callable[[], str] | None = None
                    ) -> Iterator[dict[str, dict[int, int]]]:
    """Within, each forward of ``model`` notes, by layer key, the storages (address: bytes)
    of its ``nn.Linear`` modules' inputs and outputs, for :func:`deferred_bytes`, and under
    ``key + OUTPUTS`` the outputs of every module holding weights of its own (a Linear, a
    norm, Hugging Face's ``Conv1D``), for :func:`recorded_bytes`. A module whose weight
    several layers use (a tied embedding and head) is noted under the layer ``running``
    names, the one calling it."""
    owners: dict[int, list[str]] = {}
    for s in layers:
        for p in s.params:
            owners.setdefault(id(p), []).append(s.key)
    noted: dict[str, dict[int, int]] = {}

    def hook(keys: list[str], m: nn.Module, args: Any, out: Any) -> None:
        now = running() if running is not None and len(keys) > 1 else ""
        key = now if now in keys else keys[-1]
        if isinstance(m, nn.Linear):
            noted.setdefault(key, {}).update({**storages(args), **storages(out)})
        noted.setdefault(key + OUTPUTS, {}).update(storages(out))

    handles = [m.register_forward_hook(partial(hook, owners[id(own[0])]))
               for m in model.modules()
               if (own := [p for p in m.parameters(recurse=False) if p.requires_grad])
               and id(own[0]) in owners]
    try:
        yield noted
    finally:
        for h in handles:
            h.remove()


def deferred_bytes(noted: dict[str, dict[int, int]], layers: Sequence[Step], env: Env
                   ) -> list[int]:
    """Each layer's ``deferred_bytes`` (module docstring) from :func:`linear_operands`'
    storages, less the layer's inputs'."""
    out = []
    for step in layers:
        own = storages([env[d] for d in step.deps])
        out.append(sum(n for ptr, n in noted.get(step.key, {}).items() if ptr not in own))
    return out


def recorded_bytes(noted: dict[str, dict[int, int]], layers: Sequence[Step]) -> list[int]:
    """Each layer's ``recorded_bytes``: the storages of its weight-holding modules'
    outputs, the size of the gradients a split backward's ``B`` keeps for ``W`` at the
    nodes that lead to a weight (their inputs are kept tensors)."""
    return [sum(noted.get(step.key + OUTPUTS, {}).values()) for step in layers]


def library_bytes(model: nn.Module, steps: Sequence[Step], output_key: str, sample: Any,
                  loss: Loss) -> dict[str, int]:
    """What the process keeps after each layer's first forward and backward (by step key),
    the model run in order on ``sample``, each layer on fresh leaves with a gradient of
    ones (the last through ``loss``), twice, its Linear weight gradients made as the
    runtime makes them; empty where it cannot be read (module docstring)."""
    libc = glibc()
    first = next(tensors(sample), None)
    if libc is None or not _STATUS.exists() or first is None or first.device.type != "cpu":
        return {}
    if not (torch.is_autocast_enabled("cpu") or any(
            p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())):
        return {}  # fp32: the BLAS's process-wide buffers, which a rank fills anyway

    def anon() -> int:
        libc.malloc_trim(0)
        return _anonymous()

    env: Env = {INPUT: sample}
    found: dict[str, int] = {}
    with _as_the_runtime(model) as sink:
        for step in steps:
            if not step.may_be_layer:  # glue: reads what it reads, as the record pass does
                env[step.key] = detach(step.run(env))
                continue
            before = anon()
            for _ in range(2):  # the second adds its weight gradients to the first's
                _first_run(step, env, loss if step.key == output_key else None)
            sink.take()
            if torch.is_autocast_enabled(first.device.type):
                torch.clear_autocast_cache()  # one forward's casts, not kept across forwards
            if any(True for _ in tensors(env[step.key])):
                kept = sum(storages(env[step.key]).values())
                found[step.key] = max(0, anon() - before - kept)
    return found


def sent_bytes(value: Any, autocast: torch.dtype | None) -> int:
    """A layer's output as it crosses to another stage: under autocast, its floating
    tensors in the autocast dtype (the runtime sends them so)."""
    size = (torch.empty((), dtype=autocast).element_size() if autocast is not None else 0)
    return sum(t.numel() * (size if size and t.is_floating_point() else t.element_size())
               for t in tensors(value))


def with_library(layers: list[Layer], first_use: list[int | None]) -> list[Layer]:
    """Each layer with the library bytes of its kind: the most any layer of that kind
    read (the first to run its kernels); unchanged where nothing could be read."""
    if any(b is None for b in first_use):
        return layers
    kind: dict[tuple[str, int, int, int], int] = {}
    for x, b in zip(layers, first_use, strict=True):
        kind[x.kernel_kind] = max(kind.get(x.kernel_kind, 0), b or 0)
    return [replace(x, library_bytes=kind[x.kernel_kind]) for x in layers]


#: How a stage's ``nn.Linear`` layers make their weight gradients, for :func:`library_bytes`
#: to run the same kernels: a context manager over a model, yielding a sink whose
#: ``take()`` drops the update's sums. The runtime registers it
#: (:func:`dreampipe.runtime.fused.linears_as_a_stage`); profiling sits below the runtime.
RUNTIME_LINEARS: list[Callable[[nn.Module], AbstractContextManager[Any]]] = []


@contextmanager
def _as_the_runtime(model: nn.Module) -> Iterator[Any]:
    """The registered way, or autograd's own where the runtime is not loaded."""
    if not RUNTIME_LINEARS:
        yield _NoSink()
        return
    with RUNTIME_LINEARS[0](model) as sink:
        yield sink


class _NoSink:
    def take(self) -> None:
        """Nothing to drop: autograd's gradients go to ``.grad``, which the runs clear."""


def _first_run(step: Step, env: Env, loss: Loss | None) -> None:
    """``step``'s forward on fresh leaves, and its backward with a gradient of ones (or
    through ``loss``, a scalar); its output, cut from the graph, goes into ``env``."""
    leaves: list[Tensor] = []
    value = step.run({d: fresh(env[d], leaves) for d in step.deps})
    env[step.key] = detach(value)
    if loss is not None:
        found = loss(value)
        outs = [found] if isinstance(found, Tensor) and found.numel() == 1 else []
    else:
        outs = [t for t in tensors(value) if t.requires_grad]
    wrt = leaves + [p for p in _params(step, env) if p.requires_grad]
    if outs and wrt and outs[0].requires_grad:
        torch.autograd.grad(outs, wrt, None if loss is not None else
                            [torch.ones_like(t) for t in outs], allow_unused=True)


def _params(step: Step, env: Env) -> list[nn.Parameter]:
    """A layer's parameters: its own, and those it reads from the model (glue's)."""
    return list(step.params) + [v for d in step.deps if isinstance(v := env[d], nn.Parameter)]


def _anonymous() -> int:
    """The process's anonymous resident bytes (``RssAnon``)."""
    for line in _STATUS.read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def new_parameter_bytes(params: Iterable[Tensor], counted: dict[int, tuple[int, int]],
                        layer: int = 0) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """Bytes of the ``params`` not yet in ``counted`` (by identity), which are added to it as
    the ``k``-th of ``layer``: a weight two layers share is counted once, in the first layer
    that uses it; the others list it as reused, ``(first, k, bytes)`` (Layer.reused)."""
    unique = {id(p): p for p in params}
    fresh = [p for key, p in unique.items() if key not in counted]
    for k, p in enumerate(fresh):
        counted[id(p)] = (layer, k)
    reused = tuple((*counted[key], p.numel() * p.element_size())
                   for key, p in unique.items() if counted[key][0] != layer)
    return sum(p.numel() * p.element_size() for p in fresh), reused

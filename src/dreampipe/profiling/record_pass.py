"""The profiler's one real pass: what each step of a model computes, saves and writes.

One forward and loss on the sample, each step on the values the steps before it made,
records every value, the loss's gradient with respect to each layer's outputs, the
storages autograd saves inside each step (:func:`saved_bytes` makes a layer's kept bytes
of them) and the layers whose forward writes a floating input in place: its version
counter moves while the layer runs. A stage after the first receives that input as a
leaf, which autograd does not let it write, so the runtime runs it on a copy
(:mod:`dreampipe.runtime.input_writes`); in one process the write lands on the layer
before's output and costs nothing. docs/design.md §2.2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from dreampipe.errors import ProfileError
from dreampipe.profiling.model_steps import INPUT, Env, Step
from dreampipe.profiling.tensor_trees import detach, storages, tensors

__all__ = ["LOSS", "Recorded", "Storages", "read_later", "record", "saved_bytes"]

#: The key of what the loss saved among the steps' saved storages.
LOSS = "<loss>"

#: Storages by address: their size in bytes.
Storages = dict[int, int]

#: :func:`record`'s values (detached), gradients by step key, saved storages by step key
#: (and :data:`LOSS`), and the keys of the steps that wrote a floating input in place.
Recorded = tuple[Env, dict[str, list[Tensor | None]], dict[str, Storages], frozenset[str]]


def record(steps: list[Step], output_key: str, sample_input: Tensor | dict[str, Tensor],
           loss_fn: Callable[..., Tensor], target: Tensor | None,
           running: list[str] | None = None, fixed: Sequence[Tensor] = ()) -> Recorded:
    """One real forward + loss (module doc); ``running[0]`` holds the key of the step
    that runs; ``fixed``: the model's weights and buffers, which a step that writes them
    (an EMA of its own) does not write as an input."""
    env: Env = {INPUT: sample_input}
    saved: dict[str, Storages] = {}
    written: set[str] = set()
    kept = set(storages(list(fixed)))
    for step in steps:
        if running is not None:
            running[0] = step.key
        noted: Storages = {}
        before = _versions(step, env, kept) if step.may_be_layer else []
        with torch.autograd.graph.saved_tensors_hooks(partial(_note_saved, noted), _unpack):
            env[step.key] = step.run(env)
        saved[step.key] = noted
        if any(t._version != v for t, v in before):
            written.add(step.key)
    output = env[output_key]
    noted = {}
    with torch.autograd.graph.saved_tensors_hooks(partial(_note_saved, noted), _unpack):
        loss = loss_fn(output) if target is None else loss_fn(output, target)
    saved[LOSS] = noted
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ProfileError(
            f"the loss function returned {type(loss).__name__} "
            f"{tuple(loss.shape) if isinstance(loss, Tensor) else ''}; it must return a scalar"
        )
    wanted = [(s.key, i, t) for s in steps if s.may_be_layer
              for i, t in enumerate(tensors(env[s.key])) if t.requires_grad]
    grads: dict[str, list[Tensor | None]] = {
        s.key: [None] * len(list(tensors(env[s.key]))) for s in steps
    }
    if wanted and loss.requires_grad:
        found = torch.autograd.grad(loss, [t for _, _, t in wanted], allow_unused=True)
        for (key, i, _), grad in zip(wanted, found, strict=True):
            grads[key][i] = grad
    return {k: detach(v) for k, v in env.items()}, grads, saved, frozenset(written)


def _versions(step: Step, env: Env, fixed: set[int]) -> list[tuple[Tensor, int]]:
    """The floating tensors ``step`` reads, but for weights and buffers (their storages
    ``fixed``), each with its version counter before it runs: the runtime copies a
    floating input it receives only (token ids never require a gradient)."""
    return [(t, t._version) for t in tensors([env[d] for d in step.deps])
            if t.is_floating_point() and not isinstance(t, nn.Parameter)
            and t.device.type != "meta" and t.untyped_storage().data_ptr() not in fixed]


def _note_saved(found: Storages, t: Tensor) -> Tensor:
    """Pack hook: note the storage of a tensor autograd saves, keep the tensor as it is."""
    found.update(storages([t]))
    return t


def _unpack(t: Tensor) -> Tensor:
    return t


def saved_bytes(saved: Storages, step: Step, env: Env, buffers: list[Tensor],
                loss: Storages | None = None, read: Any = None) -> int:
    """What a minibatch in flight keeps of ``step``'s layer: the storages it saved for the
    backward and its output (``read``, where given: the items of it later steps take,
    :func:`read_later`; the rest is dropped), less its inputs', parameters' and the
    model's ``buffers`` (other layers', weights, or a mask every microbatch shares).
    The last layer's output goes to the loss, not to a next stage: it keeps what the loss
    saved instead (``loss``), the output where the loss keeps it (a 16-bit output that a
    loss takes in 32 bits keeps the 32-bit copy)."""
    output = env[step.key] if read is None else read
    held = {**saved, **(storages(output) if loss is None else loss)}
    for ptr in storages([*(env[d] for d in step.deps), *step.params, *buffers]):
        held.pop(ptr, None)
    return sum(held.values())


def read_later(step: Step, steps: list[Step], env: Env, output_key: str) -> Any:
    """What of ``step``'s output the steps after it read: where it is a container and
    only items are taken from it (``attn(x, x, x)[0]``, an LSTM's ``out, (h, c)``), those
    items; else the whole output (docs/design.md §2)."""
    out = env[step.key]
    if isinstance(out, Tensor) or step.key == output_key:
        return out
    readers = [x for x in steps if step.key in x.deps]
    if not readers or any(x.may_be_layer or x.key == output_key or x.deps != (step.key,)
                          for x in readers):
        return out
    return [env[x.key] for x in readers]

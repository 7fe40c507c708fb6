"""Block recomputation: a stage recomputes some of its blocks, not its whole forward.

The rule (docs/design.md §4.6), Megatron-LM's ``--recompute-method block``: a stage
recomputes its first ``k`` blocks, each keeping only its inputs for the backward,
which runs its forward again; ``selective``: every block recomputes its attention only.
A **block** is an instance of the model's block class (:func:`block_class`): of the
classes listed at least twice in containers (``nn.Sequential``, ``nn.ModuleList``, a bare
``nn.Module``, the splitter's chains and segments, or the model's layers), with
parameters and submodules, the outermost; of several, the one holding most parameters.
The whole model decides, as a stage may hold one block. A block's **attention**: its
outermost submodules whose class name contains ``attention`` or ``attn``.

Non-reentrant ``torch.utils.checkpoint`` keeps the forward's graph (its edges reach the
version's tensors; Zero Bubble's ``B`` and ``W`` walk its nodes), refills saved tensors
once per backward call and replays the random state and autocast. It recomputes in the
backward, outside :class:`~.slots.ParameterSlots`: the wrapper puts the tensors the
forward ran on (the version's) back in the block's parameter slots for it, and its
buffers as the forward read them, restored afterwards, as :mod:`.recompute` does.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils.checkpoint import checkpoint

from dreampipe.errors import ConfigError

__all__ = ["BlockRecompute", "attention_modules", "block_class", "checkpoint_blocks",
           "stage_blocks"]

_HOLDERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, fx.GraphModule)


@dataclass(frozen=True)
class BlockRecompute:
    """What a stage recomputes: its first ``blocks`` blocks whole, or (``selective``)
    every block's attention. ``block``: the block class's name, :func:`block_class` of
    the whole model (:meth:`for_model`); None finds it in the stage itself."""

    blocks: int | None = None
    selective: bool = False
    block: str | None = None

    def __post_init__(self) -> None:
        if self.selective == (self.blocks is not None):
            raise ConfigError(
                f"blocks={self.blocks} with selective={self.selective}: recompute either "
                "the first blocks (blocks=k) or every block's attention (selective=True)",
                "blocks", "selective")
        if self.blocks is not None and (isinstance(self.blocks, bool) or self.blocks < 0):
            raise ConfigError(f"blocks={self.blocks}: give how many of a stage's first "
                              "blocks recompute, 0 or more", "blocks")

    def for_model(self, *modules: nn.Module) -> BlockRecompute:
        """This spec with ``block`` set to the block class of the model made of ``modules``
        (the model, or its layers), unless it names one."""
        if self.block is not None:
            return self
        return BlockRecompute(self.blocks, self.selective, block_class(*modules).__name__)


def _holder(m: nn.Module) -> bool:
    return (type(m) is nn.Module or isinstance(m, _HOLDERS)
            or type(m).__module__.startswith("dreampipe.splitter"))


def block_class(*modules: nn.Module) -> type[nn.Module]:
    """The block class of the model made of ``modules`` (the model, or its layers): the
    module docstring's rule; a ConfigError if no class repeats so."""
    listed = {id(m) for m in modules}  # given as layers, or held by a container
    for root in modules:
        listed.update(id(c) for m in root.modules() if _holder(m) for c in m.children())
    found: dict[type[nn.Module], list[nn.Module]] = {}
    seen: set[int] = set()
    for root in modules:
        for m in root.modules():
            if id(m) not in seen:
                seen.add(id(m))
                if (id(m) in listed and not _holder(m) and any(True for _ in m.children())
                        and any(True for _ in m.parameters())):
                    found.setdefault(type(m), []).append(m)
    repeated = {c: ms for c, ms in found.items() if len(ms) > 1}
    inside: dict[type[nn.Module], set[int]] = {
        c: {id(d) for m in ms for d in m.modules() if d is not m} for c, ms in repeated.items()}
    outermost = [c for c, ms in repeated.items() if not any(
        id(m) in inside[other] for other in repeated if other is not c for m in ms)]
    if not outermost:
        what = type(modules[0]).__name__ if len(modules) == 1 else f"{len(modules)} layers"
        raise ConfigError(
            f"block recomputation found no repeated block in {what}: no class of modules "
            "with parameters and submodules is listed twice in a container; leave block "
            "recomputation out (recompute_blocks, recompute_attention) and recompute whole "
            "stages instead (a plan's 'r'), or make each block a module of one class, with its "
            "layers as submodules, listed in a container (nn.ModuleList, nn.Sequential)",
            "recompute_blocks", "recompute_attention")

    def held(c: type[nn.Module]) -> int:
        params = {id(p): p for m in repeated[c] for p in m.parameters()}
        return sum(p.numel() for p in params.values())

    return max(outermost, key=held)  # the first in model order among equals


def stage_blocks(stage: nn.Module, block: type[nn.Module] | str) -> list[nn.Module]:
    """The blocks ``stage`` holds, in its order: the outermost instances of ``block``
    (a class, or its name)."""
    def match(m: nn.Module) -> bool:
        return type(m) is block if isinstance(block, type) else type(m).__name__ == block

    out: list[nn.Module] = []
    within: set[int] = set()
    for m in stage.modules():
        if match(m) and id(m) not in within:
            out.append(m)
            within.update(id(d) for d in m.modules())
    return out


def attention_modules(block: nn.Module) -> list[nn.Module]:
    """``block``'s attention: its outermost submodules whose class name contains
    ``attention`` or ``attn`` (case aside)."""
    out: list[nn.Module] = []
    within: set[int] = set()
    for m in block.modules():
        name = type(m).__name__.lower()
        if m is not block and id(m) not in within and ("attention" in name or "attn" in name):
            out.append(m)
            within.update(id(d) for d in m.modules())
    return out


def checkpoint_blocks(stage: nn.Module, spec: BlockRecompute | None, *, index: int = 0,
                      whole_stage: bool = False) -> list[nn.Module]:
    """Make pipeline stage ``index``'s module ``stage`` recompute what ``spec`` says (None:
    nothing; a ConfigError if it cannot, or with the ``whole_stage`` recomputation); the
    modules that now recompute."""
    if spec is None:
        return []
    if whole_stage:
        raise ConfigError(f"stage {index} recomputes its whole forward (recompute=True) and "
                          f"blocks too ({spec}); choose one of them", "recompute", "blocks")
    cls = spec.block if spec.block is not None else block_class(stage)
    blocks = stage_blocks(stage, cls)
    name = cls if isinstance(cls, str) else cls.__name__
    if spec.blocks is not None and spec.blocks > len(blocks):
        raise ConfigError(
            f"blocks={spec.blocks} but stage {index} holds {len(blocks)} {name} blocks; "
            f"recompute at most {len(blocks)} of them, or its whole forward (recompute=True)",
            "blocks")
    if spec.blocks is not None:
        chosen = blocks[: spec.blocks]
    else:
        chosen = []
        for b in blocks:
            found = attention_modules(b)
            if not found:
                raise ConfigError(
                    f"selective=True but {name} has no attention submodule (a submodule whose "
                    "class name contains 'Attention' or 'Attn'); recompute whole blocks "
                    "(blocks=k) instead", "selective")
            chosen += found
    for m in chosen:
        if not isinstance(m.__dict__.get("forward"), _Checkpointed):
            m.forward = _Checkpointed(m)
    return chosen


class _Checkpointed:
    """``module``'s forward under non-reentrant checkpoint, recomputed on the tensors and
    buffer values its forward read (module doc)."""

    def __init__(self, module: nn.Module) -> None:
        self.run: Callable[..., Any] = module.forward
        self.slots = [(sub, name) for sub in module.modules() for name in sub._parameters]
        self.buffers = [(sub, name) for sub in module.modules() for name in sub._buffers]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.run(*args, **kwargs)
        n, keys = len(args), tuple(kwargs)

        def call(*flat: Any) -> Any:
            return self.run(*flat[:n], **dict(zip(keys, flat[n:], strict=True)))

        # keyword arguments go by position, so checkpoint saves their tensors (and finds
        # the device) as it does the positional ones'
        return checkpoint(call, *args, *kwargs.values(), use_reentrant=False,
                          context_fn=self._contexts)

    def _contexts(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        """Called as the forward starts: a no-op for it, and the recomputation's context."""
        tensors = [sub._parameters[name] for sub, name in self.slots]
        buffers = [(sub, name, b.detach().clone()) for sub, name in self.buffers
                   if (b := sub._buffers[name]) is not None]
        return nullcontext(), _AsInForward(self.slots, tensors, buffers)


class _AsInForward:
    """The recomputation's context, entered once per backward that recomputes: the
    parameter slots hold the forward's tensors, the buffers its values; both are put
    back afterwards."""

    def __init__(self, slots: list[tuple[nn.Module, str]], tensors: list[Any],
                 buffers: list[tuple[nn.Module, str, Tensor]]) -> None:
        self.slots, self.tensors, self.buffers = slots, tensors, buffers
        self.saved: list[Any] = []
        self.values: list[Tensor] = []

    def __enter__(self) -> None:
        self.saved = [sub._parameters[name] for sub, name in self.slots]
        for (sub, name), t in zip(self.slots, self.tensors, strict=True):
            sub._parameters[name] = t
        self.values = []
        with torch.no_grad():
            for sub, name, then in self.buffers:
                b = sub._buffers[name]
                assert b is not None
                self.values.append(b.detach().clone())
                b.data.copy_(then)

    def __exit__(self, *exc: object) -> None:
        for (sub, name), t in zip(self.slots, self.saved, strict=True):
            sub._parameters[name] = t
        with torch.no_grad():
            for (sub, name, _), now in zip(self.buffers, self.values, strict=True):
                b = sub._buffers[name]
                assert b is not None
                b.data.copy_(now)  # through .data, as recompute.py: the graph may hold it
        self.saved, self.values = [], []

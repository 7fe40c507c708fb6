"""The number formats a run trains in: :class:`Precision`, and the 32-bit master weights
of a 16-bit stage (:class:`MasterWeights`).

- ``fp32``: the model's own number formats (32 bits for most; a float64 model stays
  float64); nothing is cast.
- ``bf16-mixed`` and ``fp16-mixed``: forwards under ``torch.autocast`` in that dtype;
  weights, gradients and optimizer state stay 32-bit; ``fp16-mixed`` also scales the
  loss (:mod:`.loss_scaling`), as fp16's range is too narrow for small gradients.
- ``bf16``: the stage's parameters, gradients and activations are bfloat16; the
  optimizer steps 32-bit master copies of the weights and its state is 32-bit, as
  Megatron-LM's ``--bf16`` does. A rounding to bf16 of each update would otherwise lose
  the small updates (``w + lr * g`` rounds back to ``w``). The input stage casts the
  model's floating inputs to bf16 and the last stage its output to fp32 before the loss.

In the three 16-bit precisions the tensors that cross between stages are cast to the
compute dtype (half the bytes); their gradients come back in it. docs/design.md §5.5.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn

from dreampipe.errors import ConfigError

__all__ = ["PACKED", "MasterWeights", "Precision", "cast_floating", "check_made",
           "optimizer_over"]

#: The attribute that marks a tensor packing several values, whose packer chose its dtype.
PACKED = "_dreampipe_packed"


class Precision(Enum):
    """A run's number formats (module docstring)."""

    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"
    BF16 = "bf16"
    FP16_MIXED = "fp16-mixed"

    @property
    def autocast(self) -> torch.dtype | None:
        """The dtype forwards run under ``torch.autocast`` in; None: no autocast."""
        return {Precision.BF16_MIXED: torch.bfloat16,
                Precision.FP16_MIXED: torch.float16}.get(self)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of a stage's parameters (and so of its gradients)."""
        return torch.bfloat16 if self is Precision.BF16 else torch.float32

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the activations and gradients sent between stages."""
        return self.autocast or self.param_dtype

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled (fp16's dynamic loss scale)."""
        return self is Precision.FP16_MIXED

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer steps 32-bit copies of 16-bit parameters."""
        return self.param_dtype != torch.float32

    def model_inputs(self, x: Any) -> Any:
        """The input stage's inputs ``x`` as the stage computes on them."""
        return cast_floating(x, self.param_dtype) if self.master_weights else x

    def sent(self, out: Tensor) -> Tensor:
        """A stage's output as it crosses to the next stage: in a 16-bit precision, in the
        compute dtype (a pack of several values as its packer chose, exact ids included);
        in fp32 as the model made it."""
        dtype = self.compute_dtype
        if (self is Precision.FP32 or not out.is_floating_point() or out.dtype == dtype
                or getattr(out, PACKED, False)):
            return out
        return out.to(dtype)

    def adopt(self, module: nn.Module) -> None:
        """Tell a stage ``module`` that packs what it sends (``message_dtype``) the dtype
        to pack in."""
        if hasattr(module, "message_dtype") and self is not Precision.FP32:
            setattr(module, "message_dtype", self.compute_dtype)  # noqa: B010

    def loss_input(self, out: Any) -> Any:
        """The last stage's output as its loss takes it: 32-bit."""
        return cast_floating(out, torch.float32) if self.master_weights else out

    def forwards(self, device_type: str) -> AbstractContextManager[Any]:
        """The context every forward runs in: autocast, or nothing."""
        cast = self.autocast
        return torch.autocast(device_type, cast) if cast is not None else nullcontext()



def cast_floating(x: Any, dtype: torch.dtype) -> Any:
    """``x`` (a tensor, or a tuple or dict of them) with its floating tensors in ``dtype``;
    the rest (token ids, masks of bools) as they are."""
    if isinstance(x, Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, tuple):
        return tuple(cast_floating(v, dtype) for v in x)
    if isinstance(x, list):
        return [cast_floating(v, dtype) for v in x]
    if isinstance(x, dict):
        cast = {k: cast_floating(v, dtype) for k, v in x.items()}
        try:
            return type(x)(**cast)  # a Hugging Face ModelOutput keeps its attributes
        except TypeError:
            return cast
    return x


def check_made(got: object) -> None:
    """What an optimizer factory returned must be a ``torch.optim.Optimizer``."""
    if not isinstance(got, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer returned a {type(got).__name__}, not a torch.optim.Optimizer; pass a "
            "function of the parameters, e.g. optimizer=lambda params: "
            "torch.optim.AdamW(params, lr=3e-4)", "optimizer")


def optimizer_over(factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                   params: Sequence[nn.Parameter], steps: Sequence[nn.Parameter]
                   ) -> torch.optim.Optimizer:
    """The optimizer ``factory`` makes for the model's ``params``, stepping ``steps`` (one
    each: a 32-bit master, a ZeRO chunk) in their places. The factory sees the parameters
    as the model holds them, so parameter groups it picks by shape (no weight decay on
    1-D tensors) or by identity stay as it meant them; a new optimizer holds no state, so
    its groups may take other tensors. docs/design.md §5.5."""
    made = factory(list(params))
    check_made(made)
    if any(float(v) != 0 for state in made.state.values() for k, v in state.items()
           if k == "step"):
        raise ConfigError("the optimizer factory stepped its optimizer before returning it; "
                          "return a fresh optimizer", "optimizer")
    swap = {id(p): s for p, s in zip(params, steps, strict=True)}
    for group in made.param_groups:
        if any(id(p) not in swap for p in group["params"]):
            raise ConfigError("the optimizer factory's groups hold tensors it was not given; "
                              "build the optimizer from the parameters passed to it",
                              "optimizer")
        group["params"] = [swap[id(p)] for p in group["params"]]
    if made.state:  # made with the optimizer (Adagrad's sums): made again for ``steps``
        try:
            made = type(made)(made.param_groups, **made.defaults)
        except TypeError as exc:
            raise ConfigError(
                f"{type(made).__name__} makes its state as it is built, for the parameters "
                f"given, and cannot be built again from its groups ({exc}); build it with "
                "defaults for its arguments, as torch's optimizers do", "optimizer") from exc
    return made


class MasterWeights:
    """The optimizer of a stage with the parameters ``params`` of ``module``: under a
    precision with 16-bit parameters, the module moves to that dtype and the optimizer
    steps 32-bit copies (``masters``, taken before the move, so nothing is rounded off
    the weights given); after each step the parameters take the new values, rounded.
    Otherwise the optimizer steps the parameters themselves."""

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter],
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 precision: Precision) -> None:
        self._params = list(params)
        self.copies = precision.master_weights
        self.masters: list[nn.Parameter] = (
            [nn.Parameter(p.detach().float().clone()) for p in self._params]
            if self.copies else self._params)
        if self.copies:
            module.to(precision.param_dtype)
        self.optimizer = (optimizer_over(optimizer, self._params, self.masters)
                          if self._params else None)

    def step(self, grads: Sequence[Tensor | None]) -> None:
        """One optimizer step with ``grads`` (None: the parameter got no gradient)."""
        if self.optimizer is None:
            return
        for m, g in zip(self.masters, grads, strict=True):
            m.grad = None if g is None else (g.float() if self.copies else g)
        self.optimizer.step()
        for m in self.masters:
            m.grad = None
        if self.copies:
            with torch.no_grad():
                for p, m in zip(self._params, self.masters, strict=True):
                    p.copy_(m)

    def state(self, module: nn.Module) -> dict[str, Tensor]:
        """``module``'s state, each parameter's entry (tied ones: each name) at the
        master weights' full precision."""
        state = module.state_dict(keep_vars=True)
        full = {id(p): m for p, m in zip(self._params, self.masters, strict=True)}
        return {k: full.get(id(v), v).detach() for k, v in state.items()}

    def load(self, state: Mapping[str, Tensor], names: Sequence[str]) -> None:
        """Take the master weights that ``state`` has (a checkpoint's, by parameter name;
        the module has loaded its rounding)."""
        if not self.copies:
            return
        with torch.no_grad():
            for m, name in zip(self.masters, names, strict=True):
                if name in state:
                    m.copy_(state[name])

"""Several values between two stages, as the one tensor the runtime sends.

A cut of a traced model may cross several values (a hidden state and a skip, a
mask computed once, a tuple a block returned). The runtime sends one tensor per
microbatch and link, so a stage packs what it passes on (any pytree of tensors
and JSON constants: ``None``, numbers, strings) into one flat floating-point
tensor, and the next stage unpacks it::

    [L // 256, L % 256, b0 .. bL-1, data of tensor 0, data of tensor 1, ...]

``b`` is a JSON header (one byte per element): the pytree's structure, each
tensor's dtype, shape and whether it had a gradient, each constant's value, and
the signature of the model's inputs when the next stage's graph depends on it
(:mod:`.shapes`). The data are the tensors cast to the pack's dtype (``float32``,
or ``float64`` when a tensor is), so the gradient of every floating-point value
that had one flows back through the one gradient the runtime returns. Integer
and boolean tensors (masks, ids) travel as exact floats: a value too large to be
exact in the pack's dtype is a PlanError. A 16-bit run packs in its compute dtype
(``half``) where every integer and header byte is exact in it and no float beyond
its range, else in float32. The byte counts cover every tensor sent.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from dreampipe.errors import PlanError
from dreampipe.runtime.precision import PACKED

__all__ = ["pack", "unpack", "unpack_signed"]

_HEADER = "_dreampipe_header"
_EXACT_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}
_CONSTANTS = (type(None), bool, int, float, str)
#: Headers kept parsed and built: a run's cuts, shape signatures and constants.
_CACHED = 256


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack(values: Any, where: str, sig: str | None = None,
         half: torch.dtype | None = None) -> Tensor:
    """``values`` as one flat tensor (see the module docstring); ``where`` names the cut;
    ``sig``: the signature of the model's inputs, carried along (:mod:`.shapes`);
    ``half``: a 16-bit dtype to pack in where every value is exact in it."""
    leaves, spec = pytree.tree_flatten(values)
    tensors = [t for t in leaves if isinstance(t, Tensor)]
    if not tensors:
        raise PlanError(f"{where} passes no tensor on; cut the model where a tensor flows")
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    described: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            _check_exact(leaf, dtype, where)
            described.append(["t", _dtype_name(leaf.dtype), list(leaf.shape),
                              int(leaf.requires_grad)])
        elif isinstance(leaf, _CONSTANTS):
            described.append(["c", leaf])
        else:
            raise PlanError(
                f"{where} passes a {type(leaf).__name__} on; dreampipe sends tensors and "
                "constants (None, numbers, strings) between stages: cut the model elsewhere")
    if half is not None and dtype == torch.float32 and all(_exact(t, half) for t in tensors):
        dtype = half
    header, head = _head(spec, json.dumps(described), sig, dtype, tensors[0].device)
    out = torch.cat([head, *(t.to(dtype).reshape(-1) for t in tensors)])
    if out.is_meta:
        setattr(out, _HEADER, header)
    setattr(out, PACKED, True)
    return out


@functools.lru_cache(maxsize=_CACHED)
def _head(spec: pytree.TreeSpec, described: str, sig: str | None, dtype: torch.dtype,
          device: torch.device) -> tuple[bytes, Tensor]:
    """The header of a pack and its first elements: built once per structure, as every
    microbatch of a cut sends the same (only read: the pack copies it)."""
    header = json.dumps({"spec": pytree.treespec_dumps(spec), "leaves": json.loads(described),
                         "sig": sig}).encode()
    return header, torch.tensor([len(header) // 256, len(header) % 256, *header], dtype=dtype,
                                device=device)


@functools.lru_cache(maxsize=_CACHED)
def _read(header: bytes) -> tuple[Any, pytree.TreeSpec]:
    """A header's description and pytree structure, parsed once per structure."""
    desc = json.loads(header)
    return desc, pytree.treespec_loads(desc["spec"])


def _exact(t: Tensor, dtype: torch.dtype) -> bool:
    """Whether ``t`` travels exactly in ``dtype``: floating values are rounded on purpose,
    but not past its largest into inf (a float32 mask's ``finfo.min`` is beyond
    bfloat16's); integers must be whole numbers it holds."""
    if t.is_meta or t.dtype == torch.bool or not t.numel():
        return True
    if t.is_floating_point():
        return (t.element_size() <= 2
                or float(t.detach().abs().amax()) <= float(torch.finfo(dtype).max))
    return bool(int(t.abs().max()) <= 2 ** _EXACT_BITS[dtype])


def _check_exact(t: Tensor, dtype: torch.dtype, where: str) -> None:
    if t.is_floating_point() or t.is_meta or t.dtype in (torch.bool, torch.uint8, torch.int8):
        return
    limit = 2 ** _EXACT_BITS[dtype]
    if t.numel() and int(t.abs().max()) > limit:
        raise PlanError(
            f"{where} passes a {_dtype_name(t.dtype)} tensor with values beyond {limit}, which "
            f"a {_dtype_name(dtype)} message does not hold exactly; cut the model where no "
            "such tensor crosses")


def unpack(packed: Tensor) -> Any:
    """The values :func:`pack` packed, as views of ``packed`` (gradients flow back)."""
    return unpack_signed(packed)[0]


def unpack_signed(packed: Tensor) -> tuple[Any, str | None]:
    """The values :func:`pack` packed (as :func:`unpack`) and the signature it carried."""
    if packed.is_meta:
        header: bytes = getattr(packed, _HEADER)
    else:
        size = int(packed[0]) * 256 + int(packed[1])
        header = bytes(packed[2 : 2 + size].to(torch.uint8).tolist())
    desc, spec = _read(header)
    at = 2 + len(header)
    leaves: list[Any] = []
    # A value no gradient reached where it was packed (rotary embeddings, a float mask)
    # is unpacked detached, so no backward computes a gradient nobody takes; unless no
    # value had one: then all stay attached, and the runtime's gradient is of them.
    some_grad = any(len(d) > 3 and d[3] for d in desc["leaves"] if d[0] == "t")
    for kind, *rest in desc["leaves"]:
        if kind == "c":
            leaves.append(rest[0])
            continue
        dtype, shape = getattr(torch, rest[0]), torch.Size(rest[1])
        flat = packed[at : at + shape.numel()]
        at += shape.numel()
        if dtype.is_floating_point:
            wanted = not some_grad or len(rest) < 3 or rest[2]
            leaves.append((flat if wanted else flat.detach()).view(shape).to(dtype))
        else:
            leaves.append(flat.detach().view(shape).round().to(dtype))
    return pytree.tree_unflatten(leaves, spec), desc.get("sig")

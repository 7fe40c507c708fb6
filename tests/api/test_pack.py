"""Several values between stages, packed into one tensor and back."""

from __future__ import annotations

import pytest
import torch

from dreampipe.errors import PlanError
from dreampipe.splitter.pack import pack, unpack

__all__: list[str] = []


def test_a_pytree_of_tensors_and_constants_round_trips_with_gradients() -> None:
    h = torch.randn(2, 3, requires_grad=True)
    values = ((h, None), {"mask": torch.tensor([[True, False]]), "ids": torch.arange(4),
                          "half": torch.ones(2, dtype=torch.bfloat16), "n": 3, "s": "x"})
    packed = pack(values, "the cut")
    assert packed.dtype == torch.float32 and packed.dim() == 1
    back = unpack(packed.detach().requires_grad_(True))
    assert back[0][1] is None and back[1]["n"] == 3 and back[1]["s"] == "x"
    torch.testing.assert_close(back[0][0], h.detach(), rtol=0, atol=0)
    for key in ("mask", "ids", "half"):
        assert back[1][key].dtype == values[1][key].dtype  # type: ignore[union-attr]
        assert torch.equal(back[1][key], values[1][key])  # type: ignore[arg-type]
    grad = torch.ones_like(packed)
    packed.backward(grad)
    torch.testing.assert_close(h.grad, torch.ones(2, 3))


def test_an_integer_a_float32_message_cannot_hold_is_an_error() -> None:
    with pytest.raises(PlanError, match=r"the cut passes a int64 tensor with values beyond "
                                        r"16777216"):
        pack((torch.ones(2), torch.tensor([2**25])), "the cut")


def test_a_value_that_is_neither_tensor_nor_constant_is_an_error() -> None:
    with pytest.raises(PlanError, match=r"the cut passes a object on"):
        pack((torch.ones(2), object()), "the cut")


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_a_16_bit_run_packs_in_16_bits_where_every_integer_is_exact(half: torch.dtype) -> None:
    h = torch.randn(2, 3)
    ids = torch.arange(200)  # exact in both 16-bit formats; a header past 256 bytes too
    values = (h, {"ids": ids, "mask": torch.ones(2, 5, dtype=torch.bool), "note": "x" * 300})
    packed = pack(values, "the cut", half=half)
    assert packed.dtype == half and getattr(packed, "_dreampipe_packed", False)
    back = unpack(packed)
    torch.testing.assert_close(back[0], h.to(half).float(), rtol=0, atol=0)
    assert back[0].dtype == torch.float32 and torch.equal(back[1]["ids"], ids)
    assert back[1]["note"] == "x" * 300
    big = torch.tensor([2**11 + 1])  # exact in neither 16-bit format: the pack stays fp32
    packed = pack((h, big), "the cut", half=half)
    assert packed.dtype == torch.float32 and torch.equal(unpack(packed)[1], big)


def test_a_value_no_gradient_reached_where_packed_is_unpacked_without_one() -> None:
    """Rotary embeddings cross a cut beside the hidden state: no backward computes their
    gradient; a pack where nothing had one keeps every value attached, as before."""
    h = torch.randn(2, 3, requires_grad=True)
    cos = torch.randn(4)
    packed = pack((h * 2, cos), "the cut")
    received = packed.detach().requires_grad_(True)
    back = unpack(received)
    assert back[0].requires_grad and not back[1].requires_grad
    torch.testing.assert_close(back[1], cos, rtol=0, atol=0)
    (back[0].sum() + back[1].sum()).backward()
    assert received.grad is not None
    want = torch.zeros_like(received)
    want[-10:-4] = 1.0  # the hidden state's 6 values; not the header, not cos
    torch.testing.assert_close(received.grad, want, rtol=0, atol=0)
    plain = unpack(pack((h.detach(), cos), "the cut").requires_grad_(True))
    assert plain[0].requires_grad and plain[1].requires_grad


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_a_float_beyond_the_16_bit_range_keeps_the_pack_in_float32(half: torch.dtype) -> None:
    """A float32 attention mask of finfo.min, added to the scores, stays finite in one
    process: rounded into 16 bits it would arrive as -inf, which a run stops on."""
    h = torch.randn(2, 3)
    mask = torch.full((2, 4), torch.finfo(torch.float32).min)
    packed = pack((h, mask), "the cut", half=half)
    assert packed.dtype == torch.float32
    back = unpack(packed)
    assert torch.equal(back[1], mask) and bool(torch.isfinite(back[1]).all())
    in_range = pack((h, torch.full((2, 4), torch.finfo(half).min)), "the cut", half=half)
    assert in_range.dtype == half

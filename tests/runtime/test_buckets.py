"""How gradients fall into all-reduce buckets (:mod:`dreampipe.runtime.buckets`): a
gradient of half a bucket or more is summed where it lies, the smaller ones packed
into flat copies; sums and scale are the same either way. The collective is replaced
by one that doubles its tensor, as the sum over two equal replicas would."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from dreampipe.runtime import buckets as buckets_module
from dreampipe.runtime.buckets import GradientBuckets, in_place
from dreampipe.scheduling.actions import Action, ActionKind

__all__: list[str] = []

_CAP_MB = 1e-3  # 1000 bytes: 250 float32 values
_ACTION = Action(ActionKind.ALLREDUCE, 0, 0)


class _Done:
    def wait(self) -> None:
        pass


@pytest.fixture
def reduced(monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """The tensors the all-reduces were called on, in order; each is doubled."""
    calls: list[Tensor] = []

    def all_reduce(tensor: Tensor, *_args: Any, **_kwargs: Any) -> _Done:
        calls.append(tensor)
        tensor.mul_(2)
        return _Done()

    monkeypatch.setattr(buckets_module.dist, "all_reduce", all_reduce)
    return calls


def _params(*sizes: int, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    return [torch.zeros(n, dtype=dtype) for n in sizes]


def test_half_a_bucket_or_more_is_summed_where_it_lies(reduced: list[Tensor]) -> None:
    """Registration order: bias, weight, bias, weight; the backward makes them last
    first. Each weight (300 values, 1200 bytes, over half a bucket) is a bucket of its
    own, the biases (10 values) share one, placed at the earlier bias, after both
    weights' buckets: the weights' sums start as soon as each is final."""
    params = _params(10, 300, 10, 300)
    buckets = GradientBuckets(params, None, lambda work, _a: work.wait(), cap_mb=_CAP_MB)
    assert buckets.sizes == [1, 1, 2]
    grads = [torch.full_like(p, float(i + 1)) for i, p in enumerate(params)]
    buckets.ready(3, grads[3])
    assert len(reduced) == 1 and reduced[0].data_ptr() == grads[3].data_ptr()
    buckets.ready(2, grads[2])
    buckets.ready(1, grads[1])
    assert len(reduced) == 2 and reduced[1].data_ptr() == grads[1].data_ptr()
    buckets.ready(0, grads[0])
    packed = reduced[2]
    assert packed.numel() == 20
    assert packed.data_ptr() not in {g.data_ptr() for g in grads}
    buckets.finish([], _ACTION, 0.25)
    for i, g in enumerate(grads):
        assert torch.equal(g, torch.full_like(g, (i + 1) * 2 * 0.25)), i


def test_a_change_of_dtype_closes_the_packed_bucket(reduced: list[Tensor]) -> None:
    params = [*_params(10, 10), *_params(10, dtype=torch.bfloat16)]
    buckets = GradientBuckets(params, None, lambda work, _a: work.wait(), cap_mb=_CAP_MB)
    assert buckets.sizes == [1, 2]
    grads = [torch.ones_like(p) for p in params]
    buckets.launch(grads)
    buckets.finish([], _ACTION, 1.0)
    assert [t.dtype for t in reduced] == [torch.bfloat16, torch.float32]
    assert all(torch.equal(g, 2 * torch.ones_like(g)) for g in grads)


@pytest.mark.parametrize(("nbytes", "cap", "alone"), [
    (500, 1000, True), (499, 1000, False), (2e6, None, True), (1.9e6, None, False)])
def test_in_place_is_half_a_bucket_or_more(nbytes: float, cap: float | None,
                                           alone: bool) -> None:
    assert in_place(nbytes, cap) is alone


@pytest.mark.parametrize("layout", ["channels-last", "transposed", "strided"])
def test_a_dense_gradient_in_any_order_is_summed_where_it_lies(
        reduced: list[Tensor], layout: str) -> None:
    """A channels-last convolution's weight gradient, or a transposed one, fills its
    storage in another order of its dimensions: it is summed where it lies all the same.
    One with gaps (every other element) is summed through a copy, and copied back."""
    if layout == "channels-last":
        grad = torch.arange(300.0).reshape(5, 6, 2, 5).to(memory_format=torch.channels_last)
    elif layout == "transposed":
        grad = torch.arange(300.0).reshape(20, 15).t()
    else:
        grad = torch.arange(600.0).reshape(20, 30)[:, ::2]
    expect = grad * 2 * 0.25
    buckets = GradientBuckets([torch.zeros_like(grad)], None, lambda work, _a: work.wait(),
                              cap_mb=_CAP_MB)
    buckets.ready(0, grad)
    assert len(reduced) == 1
    shared = reduced[0].data_ptr() == grad.data_ptr()
    assert shared == (layout != "strided")
    buckets.finish([], _ACTION, 0.25)
    assert torch.equal(grad, expect)
    assert grad.stride() == expect.stride() or layout == "strided"

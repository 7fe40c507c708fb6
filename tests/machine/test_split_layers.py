"""The fixed cost of a tensor-split layer, from chains of two lengths
(:mod:`dreampipe.machine.split_layers`)."""

from __future__ import annotations

import dataclasses

import pytest

from dreampipe.machine.split_layers import ChainTimes, SplitLayerCost, split_layer_cost

__all__: list[str] = []


def _chain(layers: int, forward_ms: float, backward_ms: float, once_ms: float = 0.0
           ) -> ChainTimes:
    """A chain whose split layers pay ``forward_ms``/``backward_ms`` each beyond a plain
    layer's 0.01/0.02 ms, and ``once_ms`` per pass whatever its length."""
    plain_f, plain_b = 0.01 * layers, 0.02 * layers
    return ChainTimes(
        layers=layers,
        split_forward_s=(plain_f + forward_ms * layers + once_ms) / 1e3,
        split_backward_s=(plain_b + backward_ms * layers + once_ms) / 1e3,
        plain_forward_s=plain_f / 1e3, plain_backward_s=plain_b / 1e3)


def test_a_split_layer_costs_the_slope_beyond_the_plain_chains() -> None:
    found = split_layer_cost(_chain(2, 0.8, 1.1, once_ms=0.5), _chain(8, 0.8, 1.1, once_ms=0.5))
    assert found.forward_s == pytest.approx(0.8e-3)
    assert found.backward_s == pytest.approx(1.1e-3)


def test_a_host_busier_for_the_plain_chain_gives_no_negative_cost() -> None:
    short, long = _chain(2, 0.0, 0.0), _chain(8, 0.0, 0.0)
    slower_plain = dataclasses.replace(long, plain_forward_s=1.0, plain_backward_s=1.0)
    assert split_layer_cost(short, slower_plain) == SplitLayerCost(0.0, 0.0)
    with pytest.raises(ValueError, match="longer"):
        split_layer_cost(long, short)

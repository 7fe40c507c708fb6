"""What a stage recomputing some of its blocks keeps: the closed form and its properties."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.errors import ConfigError
from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.memory_terms import blocks_kept_bytes
from dreampipe.profiling.graph import Layer, LayerGraph

__all__: list[str] = []


def test_no_recomputation_keeps_every_block_and_all_keeps_inputs_and_one_block() -> None:
    kept, inputs = [10.0, 30.0, 20.0], [2.0, 3.0, 4.0]
    assert blocks_kept_bytes(kept, inputs, 0, 4) == 4 * 60
    assert blocks_kept_bytes(kept, inputs, 3, 4) == 4 * 9 + 30
    assert blocks_kept_bytes(kept, inputs, 1, 4) == 4 * (2 + 50) + 10


@pytest.mark.parametrize(("recomputed", "inputs"), [(4, [1.0] * 3), (-1, [1.0] * 3),
                                                    (1, [1.0] * 2)])
def test_more_blocks_than_the_stage_holds_or_missing_inputs_are_refused(
        recomputed: int, inputs: list[float]) -> None:
    with pytest.raises(ConfigError, match=f"blocks={recomputed} of 3 blocks"):
        blocks_kept_bytes([5.0] * 3, inputs, recomputed, 2)


@st.composite
def _blocks(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    """Blocks whose inputs are at most ``1 - 1/m`` of what they keep, with ``m`` in flight."""
    m = draw(st.integers(2, 8))
    kept = draw(st.lists(st.integers(1, 10**6), min_size=1, max_size=12))
    inputs = [draw(st.integers(0, k * (m - 1) // m)) for k in kept]
    return kept, inputs, m


@settings(max_examples=200, deadline=None)
@given(_blocks())
def test_recomputing_one_more_block_never_keeps_more(blocks: tuple[list[int], list[int], int]
                                                      ) -> None:
    """Block ``k`` trades ``m (kept - input)`` for at most ``kept`` more recomputed once."""
    kept, inputs, m = blocks
    held = [blocks_kept_bytes(kept, inputs, k, m) for k in range(len(kept) + 1)]
    assert all(b <= a for a, b in itertools.pairwise(held))


@settings(max_examples=200, deadline=None)
@given(_blocks(), st.data())
def test_each_microbatch_adds_what_it_keeps_and_recomputing_costs_one_block_at_most(
        blocks: tuple[list[int], list[int], int], data: st.DataObject) -> None:
    kept, inputs, m = blocks
    k = data.draw(st.integers(0, len(kept)))
    step = blocks_kept_bytes(kept, inputs, k, m + 1) - blocks_kept_bytes(kept, inputs, k, m)
    assert step == sum(inputs[:k]) + sum(kept[k:])
    assert blocks_kept_bytes(kept, inputs, k, m) <= sum(kept) * m + max(kept)


def test_a_stage_holds_a_copy_of_the_weights_it_shares_with_an_earlier_stage() -> None:
    """A head tied to the embedding (layer 2 reuses layer 0's weight): a stage of layers
    1..2 holds the head's copy, one of 0..2 holds it once."""
    layers = [Layer("embed", 1, 1, 8, 400), Layer("block", 1, 1, 8, 100),
              Layer("head", 1, 1, 8, 0, reused=((0, 0, 400),))]
    weights = RangeCosts.of(LayerGraph.chain(layers)).weights
    assert weights[0, 2] == 500 and weights[1, 2] == 500 and weights[2, 2] == 400
    assert weights[1, 1] == 100 and weights[0, 0] == 400

"""Operator partitioning: split costs in closed form, and the search against brute force."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.errors import PlanError
from dreampipe.planning.memory_terms import OptimizerTerms
from dreampipe.planning.operator_search import Link, coarsen, layer_costs, search_splits
from dreampipe.planning.splits import (
    Collective,
    Layout,
    OpKind,
    Split,
    layer_splits,
    op_kind,
    reshard,
    split_cost,
    splits_for,
)
from dreampipe.profiling.graph import Layer, LayerGraph

_MB = 1 << 20


def _linear(name: str, weights: float, out: float, ms: float = 1.0) -> Layer:
    return Layer(name, ms / 3, 2 * ms / 3, int(out), int(weights), "Linear(1024, 1024)")


def _relu(name: str, out: float, ms: float = 0.1) -> Layer:
    return Layer(name, ms / 3, 2 * ms / 3, int(out), 0, "ReLU()")


def test_ring_collectives_send_their_closed_form_share() -> None:
    assert Collective.ALL_REDUCE.wire_fraction(4) == pytest.approx(2 * 3 / 4)
    assert Collective.ALL_GATHER.wire_fraction(4) == pytest.approx(3 / 4)
    assert Collective.REDUCE_SCATTER.wire_fraction(8) == pytest.approx(7 / 8)
    assert Collective.ALL_TO_ALL.wire_fraction(4) == pytest.approx(3 / 16)
    assert Collective.ALL_REDUCE.wire_fraction(1) == 0.0
    link = Link(bandwidth=1e9, latency_s=1e-5)
    # 2(t-1) rounds of latency, then 2(t-1)/t of the bytes at the link's bandwidth
    assert link.seconds(Collective.ALL_REDUCE, 1e9, 4) == pytest.approx(6e-5 + 1.5)


def test_a_weighted_layer_splits_its_weights_only_by_features() -> None:
    layer = _linear("fc", weights=64 * _MB, out=8 * _MB)
    assert op_kind(layer) is OpKind.WEIGHTED
    batch = split_cost(layer, OpKind.WEIGHTED, Split.BATCH, 4)
    out = split_cost(layer, OpKind.WEIGHTED, Split.OUT, 4)
    inp = split_cost(layer, OpKind.WEIGHTED, Split.IN, 4)
    out = split_cost(layer, OpKind.WEIGHTED, Split.OUT, 4, input_bytes=2 * _MB)
    assert batch.weight_bytes == 64 * _MB
    assert batch.collectives == ((Collective.ALL_REDUCE, 64 * _MB),)
    assert out.collectives == ((Collective.ALL_REDUCE, 2 * _MB),)  # dx is a partial sum
    assert inp.collectives == ()
    assert out.weight_bytes == inp.weight_bytes == 16 * _MB
    assert (out.needs, out.gives) == (Layout.REPLICATED, Layout.FEATURE)
    assert (inp.needs, inp.gives) == (Layout.FEATURE, Layout.PARTIAL)
    assert inp.activation_bytes == 8 * _MB  # a partial sum is whole on every worker
    with pytest.raises(ValueError, match="cannot take split in"):
        split_cost(_relu("r", 1.0), OpKind.ELEMENTWISE, Split.IN, 4)


def test_a_block_with_a_nonlinear_tail_reduces_its_input_split_sum_inside() -> None:
    block = Layer("fc", 1.0, 2.0, 8 * _MB, 64 * _MB, "Linear(1024, 1024) + ReLU()")
    assert op_kind(block) is OpKind.WEIGHTED
    inp = split_cost(block, OpKind.WEIGHTED, Split.IN, 4)
    assert (inp.needs, inp.gives) == (Layout.FEATURE, Layout.REPLICATED)
    assert inp.collectives == ((Collective.ALL_REDUCE, 8 * _MB),)
    plain = split_cost(_linear("fc", 64 * _MB, 8 * _MB), OpKind.WEIGHTED, Split.IN, 4)
    assert plain.gives is Layout.PARTIAL and plain.collectives == ()


def test_attention_splits_its_output_by_whole_heads_and_never_its_input() -> None:
    # a head's queries, keys and values meet in one softmax: its columns stay on one
    # worker, and a partial sum of them is no input to attention
    attn = Layer("attn_in", 1.0, 2.0, 8 * _MB, 64 * _MB,
                 "Linear(768, 2304) + attention(12 heads)")
    assert layer_splits(attn, 4) == (Split.REPLICA, Split.BATCH, Split.OUT)
    assert layer_splits(attn, 8) == (Split.REPLICA, Split.BATCH)
    for split, t in ((Split.OUT, 8), (Split.IN, 4)):
        with pytest.raises(ValueError, match=f"cannot take split {split.value} over {t}"):
            split_cost(attn, OpKind.WEIGHTED, split, t)
    assert layer_splits(_linear("fc", 64 * _MB, 8 * _MB), 8) == splits_for(OpKind.WEIGHTED)
    # the search then runs 12 heads on 8 workers by samples, never 1.5 heads a worker
    chain = LayerGraph.chain([attn, _linear("out", 16 * _MB, 8 * _MB)])
    found = search_splits(chain, 8, Link(100e9, 1e-6))
    assert found.splits[0] in (Split.REPLICA, Split.BATCH)


def test_resharding_moves_what_each_direction_needs() -> None:
    assert reshard(Layout.BATCH, Layout.BATCH) == (None, None)
    assert reshard(Layout.REPLICATED, Layout.BATCH) == (None, Collective.ALL_GATHER)
    assert reshard(Layout.PARTIAL, Layout.REPLICATED) == (Collective.ALL_REDUCE, None)
    with pytest.raises(ValueError, match="partial"):
        reshard(Layout.REPLICATED, Layout.PARTIAL)


def test_coarsening_groups_each_layer_with_the_elementwise_layers_after_it() -> None:
    layers = (_relu("r0", 1), _linear("a", 1, 1), _relu("r1", 1), _relu("r2", 1),
              _linear("b", 1, 1), Layer("norm", 0.1, 0.1, 1, 8, "LayerNorm((4,))"))
    assert coarsen(LayerGraph.chain(list(layers), batch_size=8)) == [[0], [1, 2, 3], [4], [5]]


def _brute_force(graph: LayerGraph, t: int, link: Link, state: float = 0.0
                 ) -> list[tuple[float, float]]:
    """(time, memory) of every split of every layer on its own (no coarsening), resharding
    between each pair; each worker holds its weights, their gradient and ``state`` copies
    of them for the optimizer, and what its layers keep."""
    layers = graph.layers
    found: list[tuple[float, float]] = []
    choices = [splits_for(op_kind(x)) for x in layers]
    for splits in itertools.product(*choices):
        for start in (Layout.REPLICATED, Layout.BATCH):
            layout, time, memory = start, 0.0, 0.0
            for i, (layer, split) in enumerate(zip(layers, splits, strict=True)):
                size = float(layers[max(i - 1, 0)].activation_bytes)
                c = split_cost(layer, op_kind(layer), split, t, size)
                fwd, bwd = reshard(layout, c.needs)
                secs, _, _ = layer_costs(layer, split, t, link, size)
                time += link.seconds(fwd, size, t) + link.seconds(bwd, size, t) + secs
                memory += (2 + state) * c.weight_bytes + c.activation_bytes
                layout = c.gives
            if layout is Layout.PARTIAL:
                time += link.seconds(Collective.ALL_REDUCE, float(layers[-1].activation_bytes), t)
            found.append((time, memory))
    return found


@st.composite
def _chains(draw: st.DrawFn) -> LayerGraph:
    """Chains of up to 5 layers: Linears, ReLUs that keep their input's size, LayerNorms."""
    layers: list[Layer] = []
    for i in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["linear", "relu", "norm"]))
        ms = draw(st.floats(0.01, 50.0))
        prev = layers[-1].activation_bytes if layers else draw(st.integers(1, 64)) * _MB
        if kind == "relu":
            layers.append(_relu(f"r{i}", prev, ms))
        elif kind == "norm":
            layers.append(Layer(f"n{i}", ms / 3, 2 * ms / 3, prev, 8192, "LayerNorm((1024,))"))
        else:
            layers.append(_linear(f"l{i}", draw(st.integers(0, 256)) * _MB,
                                  draw(st.integers(1, 64)) * _MB, ms))
    return LayerGraph.chain(layers, batch_size=32)


@settings(max_examples=100, deadline=None)
@given(graph=_chains(), t=st.sampled_from([2, 4, 8]),
       bandwidth=st.sampled_from([1e9, 1e10, 1e11]), latency=st.sampled_from([0.0, 1e-5]),
       limit_share=st.sampled_from([None, 0.0, 0.3, 0.7]), state=st.sampled_from([0.0, 2.0]))
def test_the_search_equals_brute_force(
    graph: LayerGraph, t: int, bandwidth: float, latency: float, limit_share: float | None,
    state: float,
) -> None:
    # the limit lies between the smallest plan and the fastest, so it binds; an optimizer's
    # state weighs the weights more against what the layers keep
    link = Link(bandwidth, latency)
    every = _brute_force(graph, t, link, state)
    smallest, fastest = min(m for _, m in every), min(every)[1]
    limit = math.inf if limit_share is None else (
        smallest * (1 + 1e-9) + limit_share * (fastest - smallest))
    time = min(x for x, m in every if m <= limit)
    plan = search_splits(graph, t, link, None if limit_share is None else limit,
                         OptimizerTerms(state_copies=state))
    assert plan.time_s == pytest.approx(time, rel=1e-9, abs=1e-12)
    assert plan.memory_bytes <= limit * (1 + 1e-12)
    assert len(plan.splits) == len(graph)


def test_a_layer_too_big_for_one_worker_is_split_by_its_features() -> None:
    # 1 GB of weights: weights plus gradients are 2 GB whole, 0.5 GB split 4 ways
    layers = [_linear("embed", 16 * _MB, 4 * _MB), _relu("r", 4 * _MB),
              _linear("huge", 1024 * _MB, 4 * _MB, ms=20.0), _linear("head", 4 * _MB, _MB)]
    graph = LayerGraph.chain(layers, batch_size=32, model="big")
    link = Link(bandwidth=10e9, latency_s=5e-6)
    plan = search_splits(graph, 4, link, memory_bytes=1024 * _MB)
    assert plan.splits[2] in (Split.OUT, Split.IN)
    assert plan.memory_bytes <= 1024 * _MB
    with pytest.raises(PlanError, match=r"fits 1\.049e\+06 bytes.*smallest needs"):
        search_splits(graph, 4, link, memory_bytes=_MB)


def test_small_weights_and_big_activations_stay_batch_split() -> None:
    # Tofu's weak spot: for small models data parallelism wins, and the search knows it
    layers = [_linear(f"l{i}", _MB, 256 * _MB, ms=10.0) for i in range(4)]
    graph = LayerGraph.chain(layers, batch_size=32)
    plan = search_splits(graph, 8, Link(bandwidth=1e9))
    assert set(plan.splits) == {Split.BATCH}


def test_a_graph_that_is_not_a_chain_is_refused() -> None:
    layers = [_linear(f"l{i}", _MB, _MB) for i in range(3)]
    graph = LayerGraph(tuple(layers), ((0, 1), (1, 2), (0, 2)), 8, "skip")
    with pytest.raises(PlanError, match="needs a chain"):
        search_splits(graph, 2, Link(1e9))

"""A layer's fixed cost per call, read from a profile timed at two batch sizes."""

from __future__ import annotations

import pytest

from dreampipe.planning.plan import Plan
from dreampipe.planning.topology import Topology
from dreampipe.profiling.fixed_costs import (
    at_fraction,
    layer_times,
    meta_at_fraction,
    with_small_batch,
)
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.runplan.schedule_choice import (
    Semantics,
    choose_schedule,
    microbatch_counts,
    small_profile_batch,
)
from dreampipe.scheduling.microbatch_layout import default_microbatches
from dreampipe.simulation.action_costs import costs_from_profile


def _graph(fixed_ms: float, per_sample_ms: float, batch: int = 32, layers: int = 4
           ) -> LayerGraph:
    """Layers of ``fixed_ms + per_sample_ms x samples`` forward and twice that backward,
    profiled at ``batch`` and at 4 samples."""
    def at(n: int) -> LayerGraph:
        t = fixed_ms + per_sample_ms * n
        return LayerGraph.chain([Layer(f"l{i}", t, 2 * t, 1000 * n, 10**5) for i in
                                 range(layers)], batch_size=n)
    return with_small_batch(at(batch), at(4))


def test_a_time_at_a_fraction_lies_on_the_line_through_the_two_batches() -> None:
    assert at_fraction(5.0, 1.5, 32, 4, 0.25) == pytest.approx(2.0)  # 1 ms + 8 x 0.125
    assert at_fraction(4.0, 0.5, 32, 4, 0.25) == pytest.approx(1.0)  # no fixed part
    # a line below zero at no samples has no fixed part; a small batch slower than the large
    # one (noise) leaves a constant, never a time below either
    assert at_fraction(4.0, 0.1, 32, 4, 0.0) == 0.0
    assert at_fraction(2.0, 3.0, 32, 4, 0.5) == pytest.approx(2.0)


def test_each_microbatch_pays_the_layers_fixed_part_whole() -> None:
    """Cut into 8, a profile of 1 ms fixed and 0.125 ms a sample takes 1.5 ms a microbatch
    a layer, not an eighth of 5 ms; without the small batch, the eighth as before."""
    graph = _graph(1.0, 0.125)
    forward, backward, _ = layer_times(graph, 1 / 8)[0]
    assert (forward, backward) == (pytest.approx(1.5), pytest.approx(3.0))
    plan, topo = Plan.from_config(4, [0, 2], [1, 1]), Topology.parse("2")
    costs = costs_from_profile(graph, plan, topo, 1 / 8)
    assert costs.forward_s == pytest.approx((3.0e-3, 3.0e-3))
    plain = LayerGraph(graph.layers, graph.edges, graph.batch_size)
    assert costs_from_profile(plain, plan, topo, 1 / 8).forward_s == pytest.approx(
        (2 * 5.0e-3 / 8,) * 2)


def test_the_runtime_s_overhead_is_read_as_milliseconds_at_the_microbatch() -> None:
    """6 ms of overhead a pass at either batch is fixed: 30% of 32 samples' layers, 100% of
    4 samples'; at 4 samples the factor is the small batch's again, not the large one's."""
    big, small = _graph(1.0, 0.125), _graph(1.0, 0.125, batch=4)
    big = with_small_batch(
        LayerGraph(big.layers, big.edges, 32, meta={"runtime_forward": 1.3}),
        LayerGraph(small.layers, small.edges, 4, meta={"runtime_forward": 2.0}))
    assert meta_at_fraction(big, 1.0)["runtime_forward"] == pytest.approx(1.3)
    assert meta_at_fraction(big, 4 / 32)["runtime_forward"] == pytest.approx(2.0)


def test_the_counts_tried_divide_the_minibatch_up_to_gpipe_s() -> None:
    assert microbatch_counts((1, 1), 32) == (1, 2, 4, 8)
    assert microbatch_counts((2, 1), 12) == (2, 4, 6)
    assert microbatch_counts((3,), 16) == (default_microbatches((3,)),)  # none divides
    assert small_profile_batch(2, 32, 32) == 4 and small_profile_batch(2, 32, 4) == 0


def test_auto_takes_few_microbatches_where_each_pays_a_large_fixed_part() -> None:
    """Mostly fixed cost: one microbatch beats eight, which proportion alone would keep."""
    plan, topo = Plan.from_config(4, [0, 2], [1, 1]), Topology.parse("2")
    fixed = choose_schedule(_graph(2.0, 0.01), plan, topo, Semantics.SYNC, minibatch_size=32)
    assert fixed.microbatches <= 2
    plain = _graph(2.0, 0.01)
    proportional = choose_schedule(LayerGraph(plain.layers, plain.edges, 32), plan, topo,
                                   Semantics.SYNC, minibatch_size=32)
    assert proportional.microbatches == default_microbatches((1, 1))
    # the rate of a fixed-cost profile is the simulated one at the count kept
    kept = {c.kind: c for c in fixed.candidates}[fixed.kind]
    assert kept.microbatches == fixed.microbatches

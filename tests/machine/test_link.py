"""Which of link and cores sets a local all-reduce's pace (:func:`on_link`)."""

from __future__ import annotations

import dataclasses

import pytest

from dreampipe.machine.calibration import local_costs, local_topology
from dreampipe.machine.link import on_link
from dreampipe.planning.planner import evaluate_plan
from dreampipe.profiling.graph import Layer, LayerGraph
from machine.fixtures import DEV_MACHINE

__all__: list[str] = []


def _graph() -> LayerGraph:
    """Three layers of 10 MB weights, 0.1 s forward and 0.2 s backward each."""
    return LayerGraph.chain([
        Layer(f"l{i}", forward_ms=100.0, backward_ms=200.0, activation_bytes=1000,
              parameter_bytes=10_000_000) for i in range(3)])


def test_a_link_faster_than_the_cores_changes_nothing() -> None:
    assert on_link("10GB/s", DEV_MACHINE) == DEV_MACHINE
    assert on_link(DEV_MACHINE.bandwidth, DEV_MACHINE) == DEV_MACHINE


def test_a_slower_link_sets_the_rate_and_overlaps_the_backward() -> None:
    slow = on_link("25MB/s", DEV_MACHINE)
    assert slow.bandwidth == "25MB/s" and slow.overlap and not DEV_MACHINE.overlap
    assert dataclasses.replace(slow, bandwidth=DEV_MACHINE.bandwidth, overlap=False) \
        == DEV_MACHINE
    graph = _graph()
    plan = evaluate_plan(graph, local_topology(2, slow), [0], [2])
    costs = local_costs(graph, plan, 1.0, slow)
    # 30 MB over a 2-worker ring at 25 MB/s: 1.2 s, begun during the 0.6 s backward
    assert costs.allreduce_s[0] == pytest.approx(1.2, rel=0.01)
    hidden = dataclasses.replace(slow, overlap=False)
    waited = local_costs(graph, evaluate_plan(graph, local_topology(2, hidden), [0], [2]),
                         1.0, hidden)
    assert costs.allreduce_delay_s[0] < waited.allreduce_delay_s[0]

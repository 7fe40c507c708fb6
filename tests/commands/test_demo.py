"""The demo's plan and its timeline's window (:mod:`dreampipe.commands.demo`)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dreampipe.commands.demo import DemoOptions, _pipeline_plan, timeline_window
from dreampipe.errors import ConfigError
from dreampipe.machine.measure import local_machine
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.scheduling.actions import ActionKind
from dreampipe.scheduling.events import Event

__all__: list[str] = []


def test_timeline_window_keeps_the_asked_microbatches() -> None:
    events = [Event(0, 0, ActionKind.FORWARD, u, u, u + 0.5) for u in range(20)]
    kept = timeline_window(tuple(events), 3, 5)
    assert [e.microbatch for e in kept] == [3, 4, 5, 6, 7]
    with pytest.raises(ConfigError, match="epochs=-1"):
        DemoOptions().with_epochs(-1)


def test_demo_pipelines_when_the_planner_prefers_data_parallelism() -> None:
    # tiny weights and three equal layers: two stages cannot split them evenly
    # (12 ms for the slower), both workers on all three take 9 ms and a little
    layers = tuple(Layer(f"l{i}", 2.0, 4.0, 4 * 32 * 1024, 1024) for i in range(3))
    graph = LayerGraph(layers, tuple((i, i + 1) for i in range(2)), 32, "toy")
    said: list[str] = []
    plan = _pipeline_plan(graph, 2, local_machine(2), said.append)
    assert plan.num_stages == 2
    assert plan.config == "straight"
    assert len(said) == 1 and "data parallel" in said[0]


@given(st.lists(st.integers(0, 40), max_size=30), st.integers(0, 40), st.integers(0, 10))
def test_a_timeline_window_keeps_exactly_the_events_of_its_microbatches(
    numbers: list[int], first: int, count: int
) -> None:
    events = tuple(Event(0, 0, ActionKind.FORWARD, u, float(i), i + 0.5)
                   for i, u in enumerate(numbers))
    kept = timeline_window(events, first, count)
    assert kept == [e for e in events if first <= e.microbatch < first + count]
    assert all(first <= e.microbatch < first + count for e in kept)


def test_the_demos_epochs_must_be_positive() -> None:
    assert DemoOptions().with_epochs(2.5).epochs == 2.5
    with pytest.raises(ConfigError, match="epochs=0"):
        DemoOptions().with_epochs(0)


@pytest.mark.parametrize("epochs", [math.nan, math.inf])
def test_epochs_that_are_not_a_positive_number_are_refused(epochs: float) -> None:
    with pytest.raises(ConfigError) as info:
        DemoOptions().with_epochs(epochs)
    assert info.value.parameters == ("epochs",)

"""The links' calendar against spans worked out by hand, and its one-at-a-time property."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.simulation.link_calendar import LinkCalendar


def test_a_transfer_takes_the_earliest_gap_that_fits() -> None:
    links = LinkCalendar()
    assert links.transfer(["a"], 5.0, 2.0) == (5.0, 7.0)
    # placed later but ready earlier: the gap before fits it
    assert links.transfer(["a"], 0.0, 3.0) == (0.0, 3.0)
    # a gap too short (3..5) is passed over
    assert links.transfer(["a"], 3.0, 2.5) == (7.0, 9.5)
    assert links.transfer(["a"], 3.0, 2.0) == (3.0, 5.0)
    # another link is free
    assert links.transfer(["b"], 3.0, 2.0) == (3.0, 5.0)


def test_a_path_starts_on_each_link_no_earlier_than_on_the_one_before() -> None:
    links = LinkCalendar()
    links.transfer(["in"], 0.0, 4.0)
    # free out at 1, in only at 4: its bytes wait for the link in
    assert links.transfer(["out", "in"], 1.0, 2.0) == (1.0, 6.0)
    # the link out was held from 1 to 3 only
    assert links.transfer(["out"], 3.0, 1.0) == (3.0, 4.0)
    assert links.transfer([], 2.0, 1.0) == (2.0, 3.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["x", "y", "z"]), st.floats(0, 10),
                          st.floats(0.01, 3)), max_size=25))
def test_a_link_carries_one_transfer_at_a_time_and_none_starts_before_it_is_ready(
    bookings: list[tuple[str, float, float]],
) -> None:
    links = LinkCalendar()
    spans: dict[str, list[tuple[float, float]]] = {}
    for link, ready, duration in bookings:
        start, end = links.transfer([link], ready, duration)
        assert start >= ready and end - start == pytest.approx(duration)
        spans.setdefault(link, []).append((start, end))
    for held in spans.values():
        for (_, end), (start, _) in itertools.pairwise(sorted(held)):
            assert start >= end - 1e-9

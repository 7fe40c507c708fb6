"""Server links shared by several cuts: against the schedule's own pairs, and in the prices."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.plan import Plan
from dreampipe.planning.pricing import price_stages, slowest
from dreampipe.planning.shared_links import shared_link_seconds
from dreampipe.planning.sync import DEFAULT_SYNC
from dreampipe.planning.topology import Level, Topology
from dreampipe.profiling.graph import Layer, LayerGraph


def _by_minibatch(cut_bytes: list[float], senders: list[list[int]],
                  topology: Topology) -> list[float]:
    """The same sums, minibatch by minibatch over every round of the schedule's pairs."""
    load: Counter[tuple[int, int, int]] = Counter()
    used = []
    for s, size in enumerate(cut_bytes):
        left, right = senders[s], senders[s + 1]
        rounds = math.lcm(len(left), len(right))
        links = set()
        for m in range(rounds):
            x, y = left[m % len(left)], right[m % len(right)]
            if x // topology.levels[0].count == y // topology.levels[0].count:
                continue
            level = topology.levels[topology.level_between(x, y)]
            for link in (*topology.links_between(x, y), *topology.links_between(y, x)):
                load[link] += (level.latency + size / level.bandwidth) / rounds
                links.add(link)
        used.append(links)
    return [max((load[x] for x in links), default=0.0) for links in used]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([(2, 3), (4, 2), (2, 2, 2)]), st.data())
def test_sums_equal_the_schedules_pairs_minibatch_by_minibatch(
    shape: tuple[int, ...], data: st.DataObject,
) -> None:
    topo = Topology(tuple(Level(c, 10.0 ** (9 - k), 1e-5 * k) for k, c in enumerate(shape)))
    workers = topo.num_workers
    stages = data.draw(st.integers(2, 4))
    senders = [data.draw(st.lists(st.integers(0, workers - 1), min_size=1, max_size=5))
               for _ in range(stages)]
    sizes = [data.draw(st.floats(0, 1e9)) for _ in range(stages - 1)]
    got = shared_link_seconds(sizes, senders, topo)
    assert got == pytest.approx(_by_minibatch(sizes, senders, topo), rel=1e-9, abs=1e-15)


def test_one_level_shares_nothing() -> None:
    topo = Topology((Level(4, 1e9),))
    assert shared_link_seconds([1e9, 1e9], [[0], [1], [2]], topo) == [0.0, 0.0]


def test_three_cuts_through_one_server_are_priced_at_their_sum() -> None:
    # 2 servers of 2, stages on workers 0, 2, 1, 3: the forwards of stages 0 and 2 and
    # the gradient of stage 2 to stage 1 all leave server 0 (1 s each). A cut on its own is
    # priced 2 s; sharing the link, each is 3 s
    graph = LayerGraph.chain([Layer(f"l{i}", 1.0, 2.0, 10**9, 10**3) for i in range(4)])
    topo = Topology((Level(2, 1e12, 0.0), Level(2, 1e9, 0.0)))
    prof = RangeCosts.of(graph)
    spans = [(i, i) for i in range(4)]
    placed = [[0], [2], [1], [3]]
    alone = price_stages(prof, topo, spans, placed, DEFAULT_SYNC, shared_links=False)
    shared = price_stages(prof, topo, spans, placed, DEFAULT_SYNC)
    assert [s.comm_s for s in alone] == pytest.approx([2.0, 2.0, 2.0, 0.0])
    assert [s.shared_link_s for s in alone] == [0.0] * 4
    # each cut keeps its own price, and is no faster than the link it shares
    assert [s.comm_s for s in shared] == pytest.approx([2.0, 2.0, 2.0, 0.0])
    assert [s.shared_link_s for s in shared] == pytest.approx([3.0, 3.0, 3.0, 0.0])
    assert slowest(shared) == pytest.approx(3.0)
    plan = Plan(stages=shared, num_layers=4, time_per_minibatch_s=slowest(shared))
    assert Plan.from_dict(plan.to_dict()) == plan
    # laid in order, each server link carries one cut's two directions at most: the
    # pipeline's time does not change
    in_order = price_stages(prof, topo, spans, [[0], [1], [2], [3]], DEFAULT_SYNC)
    assert [s.comm_s for s in in_order] == pytest.approx([2e-3, 2.0, 2e-3, 0.0])
    assert [s.shared_link_s for s in in_order] == pytest.approx([0.0, 1.0, 0.0, 0.0])
    assert slowest(in_order) == slowest(price_stages(prof, topo, spans, [[0], [1], [2], [3]],
                                                     DEFAULT_SYNC, shared_links=False))

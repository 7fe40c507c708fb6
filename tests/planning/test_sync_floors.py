"""The synchronous search's floors: the stages' reach answers as a plain greedy does, and
the memory's floor stays below every choice of options that fits."""

from __future__ import annotations

import math
from itertools import combinations, product

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.planning.layout import Layout
from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_floors import (
    Reach,
    _bisect,
    envelope,
    least_largest,
    least_largest_with_cut,
    least_within,
)
from dreampipe.planning.sync_objective import PipelineKind, slots
from dreampipe.planning.sync_search import SyncSearch
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph

from .block_graphs import block_graphs

__all__: list[str] = []


def _greedy(env: np.ndarray, theta: float, most: int) -> float:
    """The fewest stages of envelope at most ``theta`` covering the layers, one row at a
    time (``most + 1`` past ``most``, inf where a layer alone is above ``theta``)."""
    n, i, count = env.shape[0], 0, 0
    while i < n:
        if count == most:
            return most + 1
        k = 0
        while i + k < n and env[i, i + k] <= theta:
            k += 1
        if k == 0:
            return math.inf
        i, count = i + k, count + 1
    return count


def _env(times: list[float], ties: bool) -> np.ndarray:
    """The envelope of a range table of layer times (sums, so it grows with the range),
    their values rounded to few digits where ``ties`` (equal entries across rows)."""
    t = np.round(np.asarray(times), 1) if ties else np.asarray(times)
    prefix = np.concatenate([[0.0], np.cumsum(t)])
    n = len(t)
    table = np.where(np.triu(np.ones((n, n), dtype=bool)),
                     prefix[None, 1:] - prefix[:-1, None], np.inf)
    return envelope([table])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(0.0, 5.0), min_size=1, max_size=30), st.booleans(),
       st.floats(0.0, 40.0), st.integers(1, 31))
def test_reach_counts_the_stages_as_a_plain_greedy(times: list[float], ties: bool,
                                                     theta: float, most: int) -> None:
    env = _env(times, ties)
    reach = Reach(env)
    assert reach.stages_within(theta, most) == _greedy(env, theta, most)
    for value in np.unique(env[np.isfinite(env)])[:8]:  # exactly at an entry: it counts
        assert reach.stages_within(float(value), most) == _greedy(env, float(value), most)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(0.0, 5.0), min_size=1, max_size=30), st.booleans(),
       st.floats(0.0, 40.0))
def test_reach_of_each_row_is_how_many_of_its_entries_are_within(times: list[float],
                                                                  ties: bool, theta: float
                                                                  ) -> None:
    env = _env(times, ties)
    n = env.shape[0]
    assert Reach(env).reach(theta) == [int(np.sum(env[i, i:] <= theta)) for i in range(n)]


def _with_cut(env: np.ndarray, fraction: float, cut: float, count: int, lo: float) -> float:
    """least_largest_with_cut's bisection, each stage's reach read from its row."""
    n = env.shape[0]

    def fits(theta: float) -> bool:
        i = 0
        for _ in range(count - 1):
            if i >= n:
                return True
            k = 0
            while i + k < n and env[i, i + k] <= (theta - cut) / fraction:
                k += 1
            if k == 0:
                break
            i += k
        return i >= n or float(env[i, n - 1]) * fraction <= theta

    return _bisect(lo, float(env[0, -1]) * fraction + cut, fits)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(0.0, 5.0, allow_subnormal=False), min_size=1, max_size=30),
       st.booleans(), st.sampled_from([0.5, 1.0, 3.0]),
       st.floats(0.0, 2.0, allow_subnormal=False), st.integers(1, 24))
def test_the_floor_with_cuts_reads_each_rows_reach_as_its_row_says(
        times: list[float], ties: bool, fraction: float, cut: float, count: int) -> None:
    """The same floor, bit for bit, whether the rows' reach is read all at once (many
    stages) or row by row (a few). (No subnormal figures: the bisection's relative
    precision does not end below the least normal number.)"""
    env = _env(times, ties)
    assert least_largest_with_cut(Reach(env), fraction, cut, count, 0.0) == _with_cut(
        env, fraction, cut, count, 0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 5.0), min_size=2, max_size=11), st.integers(1, 11))
def test_least_largest_is_the_least_largest_stage_of_any_cut(times: list[float],
                                                             count: int) -> None:
    """Over every cut of the layers into at most ``count`` stages, the least largest
    stage: the floor is at most it, and within the bisection's precision of it."""
    env = _env(times, False)
    n = len(times)
    floor = least_largest(Reach(env), count, 0.0)
    best = min(max(env[a, b - 1] for a, b in zip((0, *cuts), (*cuts, n), strict=True))
               for k in range(min(count, n)) for cuts in combinations(range(1, n), k))
    assert best - 1e-3 * env[0, -1] - 1e-12 <= floor <= best + 1e-12


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.data())
def test_least_within_is_below_every_choice_that_fits_and_tight_where_the_fastest_fits(
        rows: int, layers: int, data: st.DataObject) -> None:
    """Brute force over every row of each layer: no choice whose memory fits sums less
    time than the floor, the floor is infinite only where none fits, and it is the least
    sum where the fastest rows fit."""
    values = st.floats(0.0, 10.0, allow_nan=False)
    times = np.array(data.draw(st.lists(st.lists(values, min_size=layers, max_size=layers),
                                        min_size=rows, max_size=rows)))
    memory = np.array(data.draw(st.lists(st.lists(values, min_size=layers, max_size=layers),
                                         min_size=rows, max_size=rows)))
    room = data.draw(st.floats(0.0, 10.0 * layers))
    fitting = [sum(times[o, k] for k, o in enumerate(pick))
               for pick in product(range(rows), repeat=layers)
               if sum(memory[o, k] for k, o in enumerate(pick)) <= room]
    floor = least_within(times, memory, room)
    if not fitting:
        assert floor == math.inf
        return
    best = min(fitting)
    assert floor <= best * (1 + 1e-9) + 1e-12
    if sum(memory[np.argmin(times, axis=0), np.arange(layers)]) <= room:
        assert floor == float(np.sum(np.min(times, axis=0)))


def test_least_within_stays_below_where_large_dual_terms_cancel() -> None:
    """Only the second layer's lean row fits beside the first layer's 2 of 2, so the dual
    climbs to a large price, whose terms cancel: their rounding must not lift the floor."""
    times = np.array([[0.0, 1.5549839333308824], [0.0, 0.0]])
    memory = np.array([[2.0, 0.0], [2.0, 1.192092896e-07]])
    assert least_within(times, memory, 2.0) <= 1.5549839333308824


@settings(max_examples=80, deadline=None)
@given(block_graphs(3, (10**6, 10**8)), st.sampled_from(["4", "2x4"]),
       st.sampled_from([1, 1, 2, 3]), st.sampled_from([1, 2]), st.sampled_from([None, 1, 3]),
       st.sampled_from([(0,), (0, 1, 2, 3)]), st.data())
def test_the_memory_floor_is_below_every_plan_that_fits(
        graph: LayerGraph, shape: str, p: int, b: int, blocks: int | None,
        levels: tuple[int, ...], data: st.DataObject) -> None:
    """Any cuts, stage options and ZeRO levels whose every stage fits a memory limit sum
    at least :meth:`SyncSearch.least_taus` under that limit: stages that keep or recompute
    whole or block by block (a layout's ``-r``), sharded or not (one stage most often,
    where the limit is the stage's own need)."""
    topo = Topology.parse(shape, ["1e9B/s"] * len(shape.split("x")))
    d = topo.num_workers // p
    opts = SyncOptions(global_batch=8 * d, microbatch_size=b, tensor_split=False,
                       layout=Layout(1, p, None, None, blocks), training=Training("bf16", "adam"),
                       zero_levels=levels, memory_bytes=10**12)
    search = SyncSearch(graph, topo, opts)
    tables = search.tables(1, d, b, False)
    n, m = len(graph), 8 // b
    sl = slots(PipelineKind.FLUSH, p, m)
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=p - 1, max_size=p - 1)))
    edges = [0, *cuts, n]
    taus, needs = 0.0, 0.0
    for c in range(p):
        x = data.draw(st.integers(0, len(tables.options) - 1))
        taus += tables.time_at(x, sl.blocks[c], edges[c], edges[c + 1] - 1)[0]
        needs = max(needs, tables.memory_at(x, sl.in_flight[c], edges[c], edges[c + 1] - 1))
    tight = SyncSearch(graph, topo, SyncOptions(
        global_batch=8 * d, microbatch_size=b, tensor_split=False,
        layout=Layout(1, p, None, None, blocks), training=Training("bf16", "adam"),
        zero_levels=levels, memory_bytes=math.ceil(needs)))
    assert tight.least_taus(1, d, b, min(sl.in_flight), p, p) <= taus * (1 + 1e-9)


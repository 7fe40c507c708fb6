"""The lower bound's in-flight terms: a stage holding its minibatches in flight needs at
least the workers they say, given at most the workers after it, on any placement."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dreampipe.planning import bound_states
from dreampipe.planning import bounds as bounds_module
from dreampipe.planning.bound_memory import Ways, in_flight_terms
from dreampipe.planning.bounds import lower_bound
from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.in_flight import in_flight_counts
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.pricing import price_stages, slowest
from dreampipe.planning.split_ranges import split_options
from dreampipe.planning.split_stage import split_widths
from dreampipe.planning.sync import Sync, SyncKind
from dreampipe.planning.topology import Level, Topology
from dreampipe.profiling.graph import Layer, LayerGraph


def _chain(data: st.DataObject, n: int) -> LayerGraph:
    return LayerGraph.chain([
        Layer(f"l{i}", data.draw(st.floats(0.1, 20.0)), data.draw(st.floats(0.1, 40.0)),
              data.draw(st.sampled_from([10**5, 10**7, 10**8])),
              data.draw(st.sampled_from([10**5, 10**7, 10**8, 10**9])))
        for i in range(n)])


def _placed(data: st.DataObject, n: int, workers: int
            ) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """A partition of ``n`` layers, each stage on its own workers (some may idle)."""
    count = data.draw(st.integers(1, min(n, workers)))
    cuts = data.draw(st.sets(st.integers(1, n - 1), min_size=count - 1,
                             max_size=count - 1)) if count > 1 else set()
    edges = [0, *sorted(cuts), n]
    # each stage gets one worker of a shuffled order, the rest any stage or none (``count``)
    order = data.draw(st.permutations(range(workers)))
    rest = data.draw(st.lists(st.integers(0, count), min_size=workers - count,
                              max_size=workers - count))
    owner = dict(zip(order, [*range(count), *rest], strict=True))
    placed = [[w for w in range(workers) if owner[w] == s] for s in range(count)]
    return [(a, b - 1) for a, b in itertools.pairwise(edges)], placed


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.booleans(), st.data())
def test_a_stage_that_fits_has_the_workers_its_minibatches_in_flight_need(
        n: int, workers: int, again: bool, data: st.DataObject) -> None:
    # any stage of any plan that fits at PipeDream's count in flight, as it is or
    # recomputing, has at least the workers the in-flight terms ask of it with the
    # workers after it; the limit holds one stage's minibatches in flight just so
    fine = RangeCosts.of(_chain(data, n))
    spans, placed = _placed(data, n, workers)
    counts = [len(x) for x in placed]
    pipedream = in_flight_counts(counts, 0, aligned=False)
    tight = data.draw(st.integers(0, len(spans) - 1))
    limit = fine.memory(*spans[tight], pipedream[tight], recompute=again)
    terms = in_flight_terms([(fine, 1)], limit, True)
    for k, ((i, j), v) in enumerate(zip(spans, pipedream, strict=True)):
        if fine.memory(i, j, v) > limit and fine.memory(i, j, v, recompute=True) > limit:
            continue
        after = np.ones((n - i, 1))
        after[j - i] = sum(counts[k + 1:])
        need = terms.fewest(i, np.zeros((n - i, 1)), np.zeros((n, n, 1)), after,
                            np.ones(1), 1.0)
        assert need[j - i, 0] <= counts[k]


@pytest.mark.parametrize("sync", [Sync(SyncKind.HIERARCHICAL), Sync(SyncKind.RING)])
def test_the_first_stage_of_a_deep_pipeline_pays_for_its_minibatches_in_flight(
        sync: Sync) -> None:
    # a light layer of heavy weights, then a heavy one of none, on four workers under a
    # limit that holds two versions of the first: before three replicas of the second
    # it holds four minibatches, and replicating it costs more than the second alone,
    # so the best plan leaves workers idle; the bound knows it (and stays at most the
    # optimum, every plan searched exactly), the same program blind to it does not
    graph = LayerGraph.chain([Layer("a", 0.1, 0.2, 10**6, 10**10),
                              Layer("b", 10.0, 20.0, 10**6, 0)])
    topo = Topology((Level(4, 1e11, 1e-6),))
    fine = RangeCosts.of(graph)
    limit = int(fine.memory(0, 0, 2))
    assert fine.max_versions(limit)[0, 0] == 2
    best = plan_pipeline(graph, topo, PlanOptions(memory_bytes=limit, sync=sync,
                                                  exact=True)).time_per_minibatch_s
    bound = lower_bound(fine, topo, sync, 4 * best, (), limit, False)
    with pytest.MonkeyPatch.context() as patch:  # the same program blind to them
        patch.setattr(bounds_module, "in_flight_terms", lambda *args: None)
        blind = lower_bound(fine, topo, sync, 4 * best, (), limit, False)
    assert blind < bound <= best * (1 + 1e-9)


def _state_of(states: bound_states.BoundStates, topo: Topology, workers: list[int]) -> int:
    """The one bound state a stage on ``workers`` lies in: its span (the lowest level whose
    unit holds them all), its worker count and its count of servers."""
    unit = np.cumprod([lv.count for lv in topo.levels])
    span = next(k for k, u in enumerate(unit) if len({v // u for v in workers}) == 1)
    held = len({v // topo.levels[0].count for v in workers})
    (q,) = [q for q in range(len(states.first)) if states.span[q] == span
            and states.first[q] <= len(workers) <= states.last[q]
            and states.units_lo[q] <= held <= states.units_hi[q]]
    return q


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.sampled_from([(2, 2), (3, 2), (4,)]), st.floats(0.05, 1.0), st.booleans(),
       st.data())
def test_every_placed_plan_that_fits_is_a_path_of_the_relaxed_program(
        shape: tuple[int, ...], share: float, recompute: bool, data: st.DataObject) -> None:
    # a plan on any workers that fits its memory at PipeDream's count in flight is one
    # the relaxed program holds at its time with its in-flight terms, on its own ranges
    topo = Topology(tuple(Level(c, 1e9 * 10 ** -k, 1e-5) for k, c in enumerate(shape)))
    n = data.draw(st.integers(2, 4))
    fine = RangeCosts.of(_chain(data, n))
    limit = max(1, int(share * fine.memory(0, n - 1, 2)))
    spans, placed = _placed(data, n, topo.num_workers)
    sync = Sync(SyncKind.HIERARCHICAL)
    stages = price_stages(fine, topo, spans, placed, sync, limit)
    again = [recompute and x.memory_bytes > limit for x in stages]
    stages = price_stages(fine, topo, spans, placed, sync, limit, again)
    counts = in_flight_counts([len(x) for x in placed], 0, aligned=False)
    assume(all(fine.memory(i, j, v, recompute=a) <= limit
               for (i, j), v, a in zip(spans, counts, again, strict=True)))
    time = slowest(stages)
    states = bound_states.BoundStates(topo, sync, [1], bound_states.GRIDS[0])
    work = states.work(fine, 1, topo.overlap, limit, recompute)
    own = np.full_like(work, np.inf)
    for (a, b), workers in zip(spans, placed, strict=True):
        q = _state_of(states, topo, workers)
        own[a, b, q] = work[a, b, q]
    cuts = bounds_module._Cuts(topo, fine.cut_bytes, states)
    memory = in_flight_terms([(fine, 1)], limit, recompute)
    used = sum(len(x) for x in placed)
    assert bounds_module._workers_needed(own, states, cuts, time * (1 + 1e-9),
                                         topo.num_workers, memory) <= used


def _split_placed(data: st.DataObject, n: int, topo: Topology, widths: list[int]
                  ) -> tuple[list[tuple[int, int]], list[list[int]], list[int]]:
    """A partition of ``n`` layers, each stage of some replicas of a width of ``widths``,
    each replica on consecutive free workers of one server."""
    size, servers = topo.levels[0].count, topo.num_workers // topo.levels[0].count
    count = data.draw(st.integers(1, n))
    cuts = data.draw(st.sets(st.integers(1, n - 1), min_size=count - 1,
                             max_size=count - 1)) if count > 1 else set()
    edges = [0, *sorted(cuts), n]
    free = [list(range(u * size, (u + 1) * size)) for u in range(servers)]
    placed, chosen = [], []
    for _ in range(count):
        t = data.draw(st.sampled_from(widths))
        workers: list[int] = []
        for _ in range(data.draw(st.integers(1, topo.num_workers // t))):
            room = [u for u in range(servers)
                    if any(free[u][k:k + t] == list(range(free[u][k], free[u][k] + t))
                           for k in range(len(free[u]) - t + 1))]
            if not room:
                break
            u = data.draw(st.sampled_from(room))
            k = next(k for k in range(len(free[u]) - t + 1)
                     if free[u][k:k + t] == list(range(free[u][k], free[u][k] + t)))
            workers += free[u][k:k + t]
            del free[u][k:k + t]
        assume(workers)
        placed.append(sorted(workers))
        chosen.append(t)
    return [(a, b - 1) for a, b in itertools.pairwise(edges)], placed, chosen


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.sampled_from([(2, 2), (4, 2), (4,)]), st.floats(0.05, 1.0), st.booleans(),
       st.data())
def test_every_placed_plan_of_split_stages_that_fits_is_a_path_of_the_relaxed_program(
        shape: tuple[int, ...], share: float, recompute: bool, data: st.DataObject) -> None:
    # a plan whose stages run unsplit or split over consecutive workers of a server, on any
    # servers, that fits its memory at PipeDream's count in flight, is one the relaxed
    # program holds at its time when each width's work is read with that width's own
    # in-flight terms (bound_memory.Ways), each stage on its own way and state only
    topo = Topology(tuple(Level(c, 1e9 * 10 ** -k, 1e-5) for k, c in enumerate(shape)))
    n = data.draw(st.integers(2, 4))
    graph = _chain(data, n)
    fine = RangeCosts.of(graph)
    options = split_options(graph, topo, split_widths(topo))
    by_width: dict[int, list[RangeCosts]] = {1: [fine]}
    for x in options:
        by_width.setdefault(x.t, []).append(x.costs)
    limit = max(1, int(share * fine.memory(0, n - 1, 2)))
    spans, placed, widths = _split_placed(data, n, topo, sorted(by_width))
    # each stage runs as the way of its width that fits best at its count in flight
    sync = Sync(SyncKind.HIERARCHICAL)
    counts = in_flight_counts([len(x) // t for x, t in zip(placed, widths, strict=True)], 0,
                              widths, aligned=False)
    ways, again = [], []
    for (i, j), v, t in zip(spans, counts, widths, strict=True):
        fits = [(c.memory(i, j, v) > limit, x) for x, c in enumerate(by_width[t])
                if c.memory(i, j, v, recompute=recompute) <= limit]
        assume(fits)
        late, x = min(fits)
        ways.append(None if t == 1 else next(s for s in options if s.costs is by_width[t][x]))
        again.append(late)
    stages = price_stages(fine, topo, spans, placed, sync, limit, again, ways)
    time = slowest(stages)
    states = bound_states.BoundStates(topo, sync, sorted(by_width), bound_states.GRIDS[0])
    own = {t: np.full((n, n, len(states.first)), np.inf) for t in by_width}
    for (a, b), workers, t in zip(spans, placed, widths, strict=True):
        q = _state_of(states, topo, workers)
        table = np.min([states.work(c, t, topo.overlap, limit, recompute)
                        for c in by_width[t]], axis=0)
        own[t][a, b, q] = table[a, b, q]
    work = np.min(list(own.values()), axis=0)
    memory = Ways(tuple((own[t], in_flight_terms([(c, t) for c in by_width[t]], limit,
                                                 recompute)) for t in by_width))
    cuts = bounds_module._Cuts(topo, fine.cut_bytes, states)
    used = sum(len(x) for x in placed)
    assert bounds_module._workers_needed(work, states, cuts, time * (1 + 1e-9),
                                         topo.num_workers, memory) <= used

"""Tensor splits as a per-stage choice of the range program: its tables against the operator
search, and the program against brute force over splits, replicas and recomputation."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dreampipe.errors import PlanError
from dreampipe.planning import pricing
from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.operator_search import Link, search_splits, split_front, split_memory
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.plan import Plan
from dreampipe.planning.planner import evaluate_plan, plan_pipeline
from dreampipe.planning.pricing import price_stages, slowest
from dreampipe.planning.ranges import best_ranges
from dreampipe.planning.split_ranges import StageSplit, fits_servers, split_options
from dreampipe.planning.sync import Sync, SyncKind
from dreampipe.planning.topology import Level, Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.simulation.simulator import costs_from_profile
from tests.planning.stand_in import assert_no_slower_than
from tests.planning.test_ranges import _laid_in_order

_MB = 10**6


@st.composite
def _chains(draw: st.DrawFn, max_layers: int = 4) -> LayerGraph:
    """Random chains of Linear blocks, activations and layers the splitter cannot read."""
    n = draw(st.integers(1, max_layers))
    layers = []
    for i in range(n):
        kind = draw(st.sampled_from(["Linear(64, 64)", "Linear(64, 64) + ReLU()", "ReLU()",
                                     "LayerNorm(64)"]))
        weights = draw(st.sampled_from([10**6, 10**8, 10**9])) if "Linear" in kind else 0
        layers.append(Layer(f"l{i}", draw(st.floats(0.1, 20.0)), draw(st.floats(0.1, 40.0)),
                            draw(st.sampled_from([10**5, 10**7, 10**8])), weights, kind,
                            saved_bytes=draw(st.sampled_from([None, 10**9]))))
    return LayerGraph.chain(layers, model="chain")


def _brute(prof: RangeCosts, topo: Topology, sync: Sync, fewer: bool, memory: int | None,
           splits: tuple[StageSplit, ...], recompute: bool) -> float:
    """The fastest layout in order over every choice per stage: unsplit or any split that
    sits in servers, recomputing or not, whose stages all fit ``memory``."""
    best = math.inf
    marks = [False, True] if recompute else [False]
    with _pricing_memoised():
        for spans, placed in _laid_in_order(prof.n, topo.num_workers, fewer):
            choices = [[None, *(x for x in splits if fits_servers(r.start, r.stop, x.t, topo))]
                       for r in placed]
            for how in itertools.product(*choices):
                for flags in itertools.product(marks, repeat=len(spans)):
                    stages = price_stages(prof, topo, spans, placed, sync, memory, flags, how,
                                          shared_links=False)
                    if memory is None or all(s.memory_bytes <= memory for s in stages):
                        best = min(best, slowest(stages))
    return best


@contextmanager
def _pricing_memoised() -> Iterator[None]:
    """Inside the block, the pure functions ``price_stages`` calls per stage answer from a
    cache: brute force prices the same stage (a span of one table, in flight so many, on
    the same workers) in thousands of layouts, and recomputing it took most of the test's
    time. Each layout is still priced by ``price_stages``, with the same answers."""
    with ExitStack() as stack:
        for name in ("stage_allreduce", "cut_seconds", "in_flight_counts"):
            stack.enter_context(mock.patch.object(pricing, name, _memo(getattr(pricing, name))))
        stack.enter_context(mock.patch.object(RangeCosts, "memory", _memo(RangeCosts.memory)))
        yield


def _memo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its answers kept by its arguments' values (arrays by type, shape and bytes,
    sequences as tuples); a table (``RangeCosts``, unhashable) by identity, as the tables
    priced outlive the block."""
    seen: dict[Any, Any] = {}

    def cached(*args: Any, **kw: Any) -> Any:
        key = (*map(_key, args), *kw.items())
        if key not in seen:
            seen[key] = fn(*args, **kw)
        return seen[key]

    return cached


def _key(value: Any) -> Any:
    kind = type(value)  # by exact type: a test of isinstance per argument cost a third
    if kind is np.ndarray:
        return value.dtype.char, value.shape, value.tobytes()
    if kind is list or kind is tuple or kind is range:
        return tuple(value)
    return id(value) if kind is RangeCosts else value


_SHAPES = st.sampled_from([(2, 2), (4, 2), (2, 3)])  # innermost first: 2x2, 2x4, 3x2
_SYNC = st.sampled_from([Sync(SyncKind.HIERARCHICAL), Sync(SyncKind.RING)])


@settings(max_examples=50, deadline=None)
@given(_chains(), _SHAPES, st.sampled_from([1e8, 1e9, 1e10]), st.sampled_from([None, 0.05, 0.3,
                                                                                 1.0]),
       st.booleans(), st.booleans(), _SYNC)
def test_split_choices_in_the_program_equal_brute_force(
    graph: LayerGraph, shape: tuple[int, int], bw: float, share: float | None, fewer: bool,
    recompute: bool, sync: Sync,
) -> None:
    topo = Topology((Level(shape[0], bw * 10, 1e-6), Level(shape[1], bw, 1e-5)))
    prof = RangeCosts.of(graph)
    splits = split_options(graph, topo, [2, 4][:1 + (shape[0] == 4)])
    assert splits
    memory = None if share is None else max(1, int(share * prof.memory(0, prof.n - 1, 2)))
    expect = _brute(prof, topo, sync, fewer, memory, splits, recompute)
    found = best_ranges(prof, topo, sync, fewer, memory, recompute=recompute, splits=splits)
    if math.isinf(expect):
        assert found is None
        return
    assert found is not None
    assert found[0] == pytest.approx(expect, rel=1e-9)
    flat = found[1]
    stages = price_stages(prof, topo, [(f.first, f.last) for f in flat],
                          [f.workers for f in flat], sync, memory, [f.recompute for f in flat],
                          [f.split for f in flat], shared_links=False)
    assert slowest(stages) == pytest.approx(found[0], rel=1e-9)
    # priced in full, its cuts no faster than the server links they share
    full = slowest(price_stages(prof, topo, [(f.first, f.last) for f in flat],
                                [f.workers for f in flat], sync, memory,
                                [f.recompute for f in flat], [f.split for f in flat]))
    assert full >= found[0] * (1 - 1e-9)
    assert memory is None or all(s.memory_bytes <= memory for s in stages)
    # splits only add choices: never slower than the program without them
    plain = best_ranges(prof, topo, sync, fewer, memory, recompute=recompute)
    assert plain is None or found[0] <= plain[0] * (1 + 1e-9)
    # the planner finds it too, and its plan round-trips through JSON
    got = plan_pipeline(graph, topo, PlanOptions(memory_bytes=memory, allow_fewer_workers=fewer,
                                                 sync=sync, recompute=recompute,
                                                 mixed_splits=True))
    assert_no_slower_than(got, full)
    assert Plan.from_dict(got.to_dict()) == got


#: Two splits as fast as each other, which only the last sum makes equal: a layout's
#: faster point, by a rounding, must not hide the one that holds less.
_TIE = LayerGraph.chain([
    Layer("l0", 1.0, 1.0, 10**5, 10**6, "Linear(64, 64)"),
    Layer("l1", 1.0, 3.0, 10**7, 10**6, "Linear(64, 64)"),
    *(Layer(f"l{i}", 1.0, b, a, 0, "ReLU()")
      for i, (b, a) in enumerate([(6.0, 10**5), (17.0, 10**5), (1.0, 10**7)], start=2)),
    Layer("l5", 1.0, 10.0, 10**5, 0, "LayerNorm(64)")], model="chain")


@settings(max_examples=30, deadline=None)
@given(_chains(6), st.sampled_from([2, 4]))
@example(_TIE, 4)
def test_a_split_stage_over_the_whole_chain_is_the_operator_search(graph: LayerGraph,
                                                                   t: int) -> None:
    topo = Topology((Level(4, 1e10, 1e-6), Level(2, 1e9, 1e-5)))
    link = Link(1e10, 1e-6)
    fast, lean = split_front(graph, t, link)
    assert fast == search_splits(graph, t, link)
    options = split_options(graph, topo, [t])
    assert options[0].splits == fast.splits and options[-1].splits == lean.splits
    for option in options:
        n = len(graph)
        found = search_splits(graph, t, link) if option.splits == fast.splits else lean
        assert float(option.costs.compute_s[0, n - 1]) == pytest.approx(found.time_s)
        for a, b in [(0, n - 1), (n // 2, n - 1), (0, n // 2)]:
            assert option.costs.memory(a, b, 3) == split_memory(
                graph, a, b, option.layers(a, b), t, 3, 3)


def test_a_replica_of_a_split_stays_inside_one_server() -> None:
    topo = Topology((Level(4, 1e10, 1e-6), Level(2, 1e9, 1e-5)))
    assert fits_servers(0, 8, 4, topo) and fits_servers(2, 4, 2, topo)
    assert not fits_servers(2, 6, 4, topo)  # workers 2..5 span two servers
    assert not fits_servers(0, 6, 4, topo)  # not whole replicas
    assert not fits_servers(0, 8, 8, topo)  # wider than a server


def _wide() -> LayerGraph:
    """Heavy Linear layers first (a split pays), light ones last (replicas pay)."""
    big = [Layer(f"big{i}", 4.0, 8.0, 4 * _MB, 800 * _MB, "Linear(8192, 8192) + GELU()")
           for i in range(4)]
    small = [Layer(f"small{i}", 3.0, 6.0, 4 * _MB, 4 * _MB, "Linear(1024, 1024) + ReLU()")
             for i in range(4)]
    return LayerGraph.chain([*big, *small], batch_size=8, model="wide")


def test_evaluate_plan_prices_a_mixed_plan_as_the_planner_and_the_simulator() -> None:
    graph = _wide()
    topo = Topology((Level(4, 100e9, 1e-6), Level(2, 10e9, 1e-5)))
    plan = evaluate_plan(graph, topo, [0, 4], [1, 4], tensor_parallel=[4, 1])
    assert plan.config == "1t4-4" and plan.workers_used == 8 and plan.mixes_splits
    assert plan.stage_workers(0) == (0, 1, 2, 3) and plan.stage_workers(1) == (4, 5, 6, 7)
    assert [plan.stage_of_rank(r) for r in range(8)] == [0] * 4 + [1] * 4
    with pytest.raises(PlanError, match="mixes stages split over"):
        _ = plan.tensor_parallel
    split = plan.stages[0]
    option = split_options(graph, topo, [4])[0]
    assert split.splits == option.layers(0, 3)
    assert split.compute_s == pytest.approx(float(option.costs.compute_s[0, 3]))
    assert split.memory_bytes == split_memory(graph, 0, 3, split.splits, 4, split.in_flight,
                                              split.in_flight)
    # the split stage holds a minibatch for its own replica and each of the 4 workers after
    # it, plus the join buffer: 2 for each replica of the next stage past the first (11);
    # in whole rounds it leads the next stage's 4 by max(lcm(1, 4), 2 x 4) = 8
    assert [s.in_flight for s in plan.stages] == [max(1 + 4 + 2 * 3, 4 + 8), 1]
    sim = costs_from_profile(graph, plan, topo)
    assert sim.forward_s[0] + sim.backward_s[0] == pytest.approx(split.compute_s)
    assert sim.parameter_bytes[0] == pytest.approx(sum(
        option.costs.layer_weights[:4]))  # type: ignore[index]
    assert Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(PlanError, match="one server"):
        evaluate_plan(graph, topo, [0, 4], [1, 2], tensor_parallel=[4, 1],
                      workers=[[2], [0, 1]])


def test_split_stages_in_the_plan_beat_the_whole_model_fallback() -> None:
    graph = _wide()
    topo = Topology((Level(4, 100e9, 1e-6), Level(2, 10e9, 1e-5)))
    memory = 2500 * _MB  # two big layers (1.6 GB of weights) fit one worker with 1 version
    chosen = plan_pipeline(graph, topo, PlanOptions(memory_bytes=memory, mixed_splits=True))
    assert any(s.tensor_parallel > 1 for s in chosen.stages)
    assert all(s.memory_bytes <= memory for s in chosen.stages)
    # the library default: only plans the runtime runs (one width, one replica per split)
    plain = plan_pipeline(graph, topo, PlanOptions(memory_bytes=memory))
    assert not plain.mixes_splits
    assert plain.tensor_parallel == 1 or all(s.replicas == 1 for s in plain.stages)
    assert chosen.time_per_minibatch_s < plain.time_per_minibatch_s / 2
    again = evaluate_plan(graph, topo, [s.first for s in chosen.stages],
                          [s.replicas for s in chosen.stages], memory_bytes=memory,
                          tensor_parallel=[s.tensor_parallel for s in chosen.stages])
    assert again.time_per_minibatch_s == pytest.approx(chosen.time_per_minibatch_s)

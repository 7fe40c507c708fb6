"""Stand-ins for a plan short of whole rounds: merged neighbours against every grouping of
the plan's stages and every choice of stages to recompute, priced independently, and
pipelines copied from the first servers onto the others."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from runtime.reference import admitted

from dreampipe.planning.costs import RangeCosts
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.plan import Stage
from dreampipe.planning.pricing import price_stages, slowest
from dreampipe.planning.search import Search
from dreampipe.planning.split_ranges import StageSplit
from dreampipe.planning.splits import Split
from dreampipe.planning.sync import DEFAULT_SYNC
from dreampipe.planning.topology import Level, Topology
from dreampipe.planning.whole_rounds import _copied, _groupings, _merged
from dreampipe.profiling.graph import Layer, LayerGraph


@dataclass(frozen=True)
class _Case:
    """A plan's stages (``spans``), each ``replicas[s]`` replicas of ``widths[s]`` workers
    laid in order on one server, a split of every layer over 2 workers (``split``)."""

    fine: RangeCosts
    split: StageSplit
    spans: list[tuple[int, int]]
    replicas: list[int]
    widths: list[int]


@st.composite
def _cases(draw: st.DrawFn) -> _Case:
    """A chain of 2 to 6 layers, some keeping far more than their output for the backward
    (so that recomputing pays), cut into stages of 1 to 4 replicas, each unsplit or split
    over 2 workers at half its compute, weights and activations and a cost of its own."""
    n = draw(st.integers(2, 6))
    layers, halves = [], []
    for i in range(n):
        out = draw(st.sampled_from([10**5, 10**7, 10**8]))
        fwd, bwd = draw(st.floats(0.1, 20.0)), draw(st.floats(0.1, 40.0))
        weights, saved = draw(st.sampled_from([0, 10**5, 10**7, 10**8])), draw(
            st.sampled_from([None, 8 * out]))
        layers.append(Layer(f"l{i}", fwd, bwd, out, weights, saved_bytes=saved))
        more = draw(st.floats(0.0, 1.0))  # the split's collectives, in ms
        halves.append(Layer(f"l{i}", fwd / 2 + more, bwd / 2 + more, out // 2, weights // 2,
                            saved_bytes=None if saved is None else saved // 2))
    split = StageSplit(2, (Split.OUT,) * n, RangeCosts.of(LayerGraph.chain(halves)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=4)))
    spans = [(a, b - 1) for a, b in itertools.pairwise([0, *cuts, n])]
    return _Case(RangeCosts.of(LayerGraph.chain(layers)), split, spans,
                 [draw(st.integers(1, 4)) for _ in spans],
                 [draw(st.sampled_from([1, 2])) for _ in spans])


def _whole(stages: tuple[Stage, ...]) -> bool:
    """Every stage holds what whole rounds need, counted by the runtime's reference."""
    replicas = [x.replicas for x in stages]
    widths = [x.tensor_parallel for x in stages]
    return all(x.in_flight >= admitted(replicas, i, join=0, widths=widths)
               for i, x in enumerate(stages))


@settings(max_examples=120, deadline=None)
@given(_cases(), st.floats(0.05, 1.2), st.booleans())
def test_merged_stages_are_each_groupings_best_that_holds_whole_rounds(
        case: _Case, fraction: float, recompute: bool) -> None:
    fine, spans, split = case.fine, case.spans, case.split
    sizes = [r * t for r, t in zip(case.replicas, case.widths, strict=True)]
    topo = Topology((Level(sum(sizes), 1e9, 1e-5),))
    starts = list(itertools.accumulate(sizes, initial=0))
    places = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
    ways = [split if t == 2 else None for t in case.widths]
    # a share of what the plan holds with whole rounds and a join buffer: often binding
    free = price_stages(fine, topo, spans, places, DEFAULT_SYNC, None, (), ways)
    limit = max(1, int(fraction * max(x.memory_bytes for x in free)))
    plan = price_stages(fine, topo, spans, places, DEFAULT_SYNC, limit, (), ways)
    merged_plans = list(_merged(fine, topo, PlanOptions(memory_bytes=limit).search(fine.n),
                                plan, [split], recompute))
    for stages in merged_plans:
        assert _whole(stages) and max(x.memory_bytes for x in stages) <= limit
    got = {tuple((x.first, x.last, x.tensor_parallel) for x in stages): slowest(stages)
           for stages in merged_plans}
    best: dict[tuple[tuple[int, int, int], ...], float] = {}  # per grouping and split
    for apart in itertools.product((False, True), repeat=len(spans) - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(apart) if cut), len(spans)]
        runs = list(itertools.pairwise(bounds))
        merged = [(spans[a][0], spans[b - 1][1]) for a, b in runs]
        on = [[w for p in places[a:b] for w in p] for a, b in runs]
        # a run of one keeps its way; a longer one runs unsplit, or split where one of its
        # stages is and its workers pair up
        choices = [[ways[a]] if b - a == 1 else
                   [None, *([split] if any(ways[a:b]) and len(on[k]) % 2 == 0 else [])]
                   for k, (a, b) in enumerate(runs)]
        for how in itertools.product(*choices):
            key = tuple((f, last, 1 if w is None else 2)
                        for (f, last), w in zip(merged, how, strict=True))
            for flags in itertools.product((False, True) if recompute else (False,),
                                           repeat=len(runs)):
                x = price_stages(fine, topo, merged, on, DEFAULT_SYNC, limit, flags, how)
                if _whole(x) and max(s.memory_bytes for s in x) <= limit:
                    best[key] = min(best.get(key, math.inf), slowest(x))
    assert got == best


def test_groupings_are_contiguous_runs_covering_every_stage() -> None:
    for n in range(1, 13):
        seen = set()
        for groups in _groupings(n):
            assert [i for g in groups for i in g] == list(range(n))
            assert all(len(g) >= 1 for g in groups)
            seen.add(tuple(len(g) for g in groups))
        # every grouping while few, else the plan itself and each pair of neighbours
        assert len(seen) == (2 ** (n - 1) if n <= 10 else n)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.floats(0.5, 5.0), min_size=2, max_size=6), st.sampled_from([1, 2, 4]),
       st.sampled_from([1, 2]))
def test_a_pipeline_copied_from_the_first_servers_repeats_on_every_other(
        compute: list[float], width: int, servers: int) -> None:
    graph = LayerGraph.chain([Layer(f"l{i}", c, 2 * c, 10**6, 10**5)
                              for i, c in enumerate(compute)])
    fine = RangeCosts.of(graph)
    topo = Topology((Level(4, 1e10, 1e-6), Level(4, 1e9, 1e-5)))
    opts = PlanOptions(straight=True).search(fine.n)
    got = _copied(Search(fine, fine), topo, opts, True, width, servers)
    assert got is not None
    copies = 4 // servers
    per = topo.num_workers // copies
    assert len({x.replicas for x in got}) == 1 and got[0].replicas == width * copies
    used = [w for x in got for w in x.workers]
    assert len(used) == len(set(used))
    for x in got:  # the same workers of each block of ``servers`` servers
        first = sorted(w for w in x.workers if w < per)
        assert sorted(x.workers) == sorted(w + c * per for c in range(copies) for w in first)
        assert max(x.workers) < topo.num_workers

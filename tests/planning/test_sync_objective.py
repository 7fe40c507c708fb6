"""The synchronous objective: the program against brute force, against the simulator, and
on a memory-bound case against the asynchronous objective's cuts."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dreampipe.errors import ConfigError, PlanError
from dreampipe.planning.layout import Layout, parse_layout
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.plan import Plan
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_dp import Chosen, stage_terms, update_time, whole_block_starts
from dreampipe.planning.sync_objective import PipelineKind, slots
from dreampipe.planning.sync_plan import SyncPlan
from dreampipe.planning.sync_search import MAX_VIRTUAL_STAGES, SyncSearch, plan_sync
from dreampipe.planning.sync_stage_option import Recompute, layer_blocks
from dreampipe.planning.topology import Topology
from dreampipe.profiling.gpt_spec import gpt_spec_profile, parse_gpt_spec
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.simulation.action_costs import costs_from_profile
from dreampipe.simulation.simulator import simulate_schedule
from dreampipe.simulation.zero_costs import with_zero

from .block_graphs import block_graphs


def _chain(times: list[float], acts: list[int], weights: list[int], batch: int = 4
           ) -> LayerGraph:
    layers = [Layer(f"l{i}", t, 2 * t, a, w, f"Linear({i})")
              for i, (t, a, w) in enumerate(zip(times, acts, weights, strict=True))]
    return LayerGraph.chain(layers, batch_size=batch, model="chain")


@st.composite
def _graphs(draw: st.DrawFn) -> LayerGraph:
    n = draw(st.integers(1, 5))
    return _chain([draw(st.floats(0.1, 10.0)) for _ in range(n)],
                  [draw(st.sampled_from([0, 10**6, 10**8])) for _ in range(n)],
                  [draw(st.sampled_from([0, 10**6, 10**7])) for _ in range(n)])


@st.composite
def _heavy_graphs(draw: st.DrawFn) -> LayerGraph:
    """Chains whose weights' state, not their activations, fills the memory: where
    sharding it is what fits."""
    n = draw(st.integers(1, 5))
    return _chain([draw(st.floats(0.1, 10.0)) for _ in range(n)],
                  [draw(st.sampled_from([10**6, 10**7])) for _ in range(n)],
                  [draw(st.sampled_from([10**7, 10**8])) for _ in range(n)])


def _compositions(n: int, parts: int) -> Iterator[list[tuple[int, int]]]:
    for cuts in itertools.combinations(range(1, n), parts - 1):
        edges = [0, *cuts, n]
        yield [(edges[k], edges[k + 1] - 1) for k in range(parts)]


def _brute(graph: LayerGraph, topo: Topology, opts: SyncOptions) -> float:
    """Every choice, every cut and every stage option, priced by the program's tables."""
    search = SyncSearch(graph, topo, opts)
    n, workers, batch = len(graph), topo.num_workers, opts.global_batch
    layout = opts.layout
    best = math.inf
    for d in range(1, workers + 1):
        if batch % d or (layout is not None and d != workers // (layout.t * layout.p)):
            continue
        sizes = [opts.microbatch_size] if opts.microbatch_size else range(1, batch // d + 1)
        for b in (x for x in sizes if batch // d % x == 0):
            m = batch // (d * b)
            for p in range(1, min(workers // d, n) + 1):
                if layout is not None and p != layout.p:
                    continue
                kinds = [(k, 1) for k in opts.kinds if k is not PipelineKind.INTERLEAVED]
                if PipelineKind.INTERLEAVED in opts.kinds and p > 1 and m % p == 0:
                    kinds += [(PipelineKind.INTERLEAVED, v)
                              for v in range(2, MAX_VIRTUAL_STAGES + 1) if p * v <= n]
                if layout is not None and layout.v is not None:
                    kinds = [(k, v) for k, v in kinds if v == layout.v]
                for kind, v in kinds:
                    sl = slots(kind, p, m, v)
                    tables = search.tables(1, d, b, kind is PipelineKind.ZB_H1)
                    count = len(tables.options)
                    starts = whole_block_starts(layer_blocks(graph), sl.count)
                    for spans in _compositions(n, sl.count):
                        if opts.whole_blocks and tuple(i for i, _ in spans) != starts:
                            continue
                        # a stage's terms depend on its own span and option only
                        each = [stage_terms(tables, sl, [Chosen(i, j, x) for i, j in spans],
                                            opts.memory_bytes) for x in range(count)]
                        for picks in itertools.product(range(count), repeat=sl.count):
                            terms = [each[x][c] for c, x in enumerate(picks)]
                            best = min(best, update_time(terms))
    return best


def _as_brute_force(graph: LayerGraph, topo: Topology, opts: SyncOptions) -> SyncPlan | None:
    """The program's plan, checked against :func:`_brute`'s time; None where brute force
    finds no plan (and the program says so)."""
    expect = _brute(graph, topo, opts)
    if not math.isfinite(expect):
        with pytest.raises(PlanError, match="no synchronous plan"):
            plan_sync(graph, topo, opts)
        return None
    found = plan_sync(graph, topo, opts)
    assert found.time_per_update_s == pytest.approx(expect, rel=1e-9)
    return found


_KINDS = st.sampled_from([tuple(PipelineKind), (PipelineKind.FLUSH,),
                          (PipelineKind.ZB_H1, PipelineKind.INTERLEAVED)])


@settings(max_examples=150, deadline=None)
@given(_graphs(), st.sampled_from(["2", "4", "2x2"]), st.sampled_from([1e8, 1e10]),
       st.sampled_from([1, 2, 4, 8]), _KINDS, st.sampled_from([None, 10**8, 3 * 10**8, 10**9]),
       st.booleans(), st.sampled_from([None, "bf16"]), st.sampled_from([None, 1, 2]))
@example(_chain([8.0, 9.6, 8.0], [10**8, 0, 10**6], [10**6, 10**7, 0]), "2", 1e8, 8,
         tuple(PipelineKind), 10**8, True, None, 1)  # only a recomputing stage fits
def test_the_program_finds_what_brute_force_finds(
        graph: LayerGraph, shape: str, bandwidth: float, batch: int,
        kinds: tuple[PipelineKind, ...], memory: int | None, recompute: bool,
        precision: str | None, size: int | None) -> None:
    topo = Topology.parse(shape, [f"{bandwidth}B/s"] * len(shape.split("x")))
    size = None if size is None else min(size, batch)
    opts = SyncOptions(global_batch=batch, microbatch_size=size, memory_bytes=memory,
                       kinds=kinds,
                       recompute=recompute, tensor_split=False,
                       training=Training(precision, "adam"))
    found = _as_brute_force(graph, topo, opts)
    if found is None:
        return
    assert found.global_batch == found.data_parallel * found.microbatches * \
        found.microbatch_size


@settings(max_examples=60, deadline=None)
@given(_heavy_graphs(), st.sampled_from(["2", "4", "2x2"]), st.sampled_from([4, 8]),
       st.sampled_from([None, 3 * 10**8, 10**9]), st.booleans())
def test_brute_force_agrees_when_each_stage_chooses_its_zero_level(
        graph: LayerGraph, shape: str, batch: int, memory: int | None, recompute: bool) -> None:
    """With every ZeRO level offered, each replicated stage picks its own: the program
    finds what brute force finds over every choice, cut and per-stage option, and never a
    slower plan than level 0 alone."""
    topo = Topology.parse(shape, ["1e9B/s"] * len(shape.split("x")))
    opts = SyncOptions(global_batch=batch, memory_bytes=memory, kinds=(PipelineKind.FLUSH,),
                       recompute=recompute, tensor_split=False,
                       training=Training("bf16", "adam"), zero_levels=(0, 1, 2, 3))
    found = _as_brute_force(graph, topo, opts)
    if found is None:
        return
    try:
        alone = plan_sync(graph, topo, replace(opts, zero_levels=(0,))).time_per_update_s
    except PlanError:
        return
    assert found.time_per_update_s <= alone * (1 + 1e-9)


@settings(max_examples=80, deadline=None)
@given(block_graphs(), st.sampled_from(["2", "4", "2x2"]), st.sampled_from([4, 8]),
       st.sampled_from([None, 10**8, 4 * 10**8]), st.sampled_from([1, 2]),
       st.sampled_from([0, 1, 2, 3]), st.sampled_from([None, 1, 2]),
       st.sampled_from([None, 2]), st.booleans())
@example(LayerGraph.chain([  # the best plan has a larger pipeline term and smaller tails
    Layer("embed", 0.1, 0.2, 10**6, 10**6, "Embedding"),
    Layer("b0.attn", 1.0, 2.0, 10**6, 10**6, "Linear(1)"),
    Layer("b0.mlp", 0.5, 1.0, 10**6, 10**6, "Linear(1)"),
    Layer("b1.attn", 1.0, 2.0, 10**6, 10**7, "Linear(1)"),
    Layer("b1.mlp", 1.0, 2.0, 10**6, 10**6, "Linear(1)"),
    Layer("head", 1.0, 2.0, 10**6, 10**7, "Linear(2)")], batch_size=4, model="blocks"),
    "4", 4, None, 2, 2, None, 2, False)
def test_brute_force_agrees_over_zero_levels_and_recomputed_blocks(
        graph: LayerGraph, shape: str, batch: int, memory: int | None, p: int, zero: int,
        blocks: int | None, v: int | None, whole: bool) -> None:
    """A layout's ZeRO level and recomputed blocks (and virtual stages), with cuts
    anywhere or between whole blocks: the program finds what brute force finds over every
    remaining choice, cut and stage option."""
    topo = Topology.parse(shape, ["1e9B/s"] * len(shape.split("x")))
    kinds = (PipelineKind.INTERLEAVED,) if v else (PipelineKind.FLUSH, PipelineKind.ZB_H1)
    opts = SyncOptions(global_batch=batch, memory_bytes=memory, kinds=kinds,
                       layout=Layout(1, p, v, zero, blocks), tensor_split=False,
                       training=Training("bf16", "adam"), whole_blocks=whole)
    try:
        found = plan_sync(graph, topo, opts)
    except PlanError as err:
        if "do not divide them" in str(err):  # refused before any choice
            assert len(set(layer_blocks(graph)) - {None}) % (p * (v or 1)) != 0
            return
        assert not math.isfinite(_brute(graph, topo, opts))
        return
    assert found.time_per_update_s == pytest.approx(_brute(graph, topo, opts), rel=1e-9)
    assert all(st.option.zero == zero for st in found.stages)
    if whole:
        starts = whole_block_starts(layer_blocks(graph), p * (v or 1))
        assert tuple(st.first for st in found.stages) == starts
        free = plan_sync(graph, topo, replace(opts, whole_blocks=False))
        assert free.time_per_update_s <= found.time_per_update_s * (1 + 1e-9)


@settings(max_examples=15, deadline=None)
@given(block_graphs(), st.sampled_from(["2", "4", "2x2"]), st.sampled_from([4, 8]),
       st.sampled_from([None, 10**8, 4 * 10**8]),
       st.sampled_from([(PipelineKind.FLUSH,), (PipelineKind.ZB_H1,)]),
       st.sampled_from([(0,), (0, 3)]))
def test_brute_force_agrees_when_the_free_search_recomputes_blocks(
        graph: LayerGraph, shape: str, batch: int, memory: int | None,
        kinds: tuple[PipelineKind, ...], zero: tuple[int, ...]) -> None:
    """Asked to weigh block-by-block recomputation, the free search (no layout) finds
    what brute force finds over every choice, cut and stage option, blocks included."""
    topo = Topology.parse(shape, ["1e9B/s"] * len(shape.split("x")))
    opts = SyncOptions(global_batch=batch, memory_bytes=memory, kinds=kinds, recompute=True,
                       recompute_blocks=True, tensor_split=False,
                       training=Training("bf16", "adam"), zero_levels=zero)
    assert Recompute.BLOCKS in {o.recompute for o in SyncSearch(graph, topo, opts).options(1)}
    _as_brute_force(graph, topo, opts)


@settings(max_examples=20, deadline=None)
@given(st.one_of(_graphs(), _heavy_graphs()), st.sampled_from(["2x2", "4"]),
       st.sampled_from([1e8, 1e10]), st.sampled_from([4, 8]),
       st.sampled_from([None, 3 * 10**7, 3 * 10**8, 10**9]),
       st.sampled_from([(0,), (0, 1, 2, 3), (2, 3)]))
def test_each_choice_takes_at_least_its_floor_and_the_band_keeps_its_optimum(
        graph: LayerGraph, shape: str, bandwidth: float, batch: int, memory: int | None,
        levels: tuple[int, ...]) -> None:
    """The search skips a choice by its floors (its memory's among them), a choice that
    cannot hold the weights' state, and stages longer than the band: each must lose
    nothing, at every ZeRO level offered."""
    topo = Topology.parse(shape, [f"{bandwidth}B/s"] * len(shape.split("x")))
    search = SyncSearch(graph, topo, SyncOptions(
        global_batch=batch, memory_bytes=memory, recompute=True,
        training=Training("bf16", "adam"), zero_levels=levels))
    kept = set(search.choices())
    for choice in search.choices(fit=False):
        found = search.run(choice)
        if choice not in kept:
            assert found is None
        if found is None:
            continue
        floor = search.floor(choice)
        assert floor <= search.floor_with_cuts(choice, floor) <= found[0] * (1 + 1e-12)
        banded = search.run(choice, found[0] * (1 + 1e-9))
        assert banded is not None and banded[0] == found[0]


def _simulated(graph: LayerGraph, plan: Plan, topo: Topology, kind: ScheduleKind,
               batch: int, b: int, v: int = 1) -> tuple[float, int]:
    """Seconds per update of ``plan`` under ``kind`` with microbatches of ``b``, and the
    largest peak memory of a rank, each stage at its ZeRO level."""
    per = batch // b
    schedule = build_schedule([st.replicas for st in plan.stages], kind, 2 * per, per,
                              virtual_stages=v)
    costs = with_zero(costs_from_profile(graph, plan, topo, b / graph.batch_size), schedule,
                      plan.zero_levels(0))
    result = simulate_schedule(schedule, costs, record_events=False)
    return result.makespan_s / 2, max(result.peak_memory_bytes)


@pytest.mark.parametrize("kind", list(PipelineKind))
def test_equal_stages_take_the_simulators_time(kind: PipelineKind) -> None:
    graph = _chain([3.0] * 8, [0] * 8, [0] * 8, batch=8)
    interleaved = kind is PipelineKind.INTERLEAVED
    topo = Topology.parse("2" if interleaved else "4", ["10GB/s"], None, ["0us"])
    layout = Layout(1, 2, 2) if interleaved else Layout(1, 4)
    found = plan_sync(graph, topo, SyncOptions(global_batch=16, microbatch_size=2,
                                               kinds=(kind,), layout=layout))
    plan = found.plan()
    assert plan is not None and found.microbatches == 8
    took, _ = _simulated(graph, plan, topo, ScheduleKind(kind.value), 16, 2,
                         found.virtual_stages)
    assert found.time_per_update_s == pytest.approx(took, rel=1e-9)


def test_a_memory_bound_sync_plan_cuts_elsewhere_and_runs_1f1b_flush_faster() -> None:
    """Under 100 MB no worker holds the whole model: the asynchronous objective stashes
    weights and holds whole minibatches, the synchronous one microbatches of the global
    batch, so it balances the pipeline where the other cannot (both unsharded)."""
    graph = _chain([1.0] * 8, [8 * 10**6] * 2 + [2 * 10**6] * 2 + [10**6] * 4,
                   [10**6] * 2 + [4 * 10**6] * 2 + [10**7] * 4, batch=8)
    topo, limit, batch = Topology.parse("4", ["10GB/s"]), 10**8, 32
    with pytest.raises(PlanError):  # memory-bound: data parallelism does not fit
        plan_sync(graph, topo, SyncOptions(global_batch=batch, memory_bytes=limit,
                                           layout=Layout(1, 1), zero_levels=(0,)))
    async_plan = plan_pipeline(graph, topo, PlanOptions(memory_bytes=limit,
                                                        tensor_split=False))
    found = plan_sync(graph, topo, SyncOptions(global_batch=batch, memory_bytes=limit,
                                               kinds=(PipelineKind.FLUSH,),
                                               tensor_split=False, zero_levels=(0,)))
    sync_plan = found.plan()
    assert sync_plan is not None
    spans = [(s.first, s.last) for s in sync_plan.stages]
    assert spans != [(s.first, s.last) for s in async_plan.stages]
    took, peak = _simulated(graph, sync_plan, topo, ScheduleKind.FLUSH, batch,
                            found.microbatch_size)
    assert took <= found.time_per_update_s * (1 + 1e-9) and peak <= limit
    for b in (1, 2, 4, 8, 16, 32):  # the asynchronous cuts at every microbatch size
        assert _simulated(graph, async_plan, topo, ScheduleKind.FLUSH, batch, b)[0] > took


def test_bf16_adam_keeps_megatrons_sixteen_bytes_a_weight_and_zero_shards_them() -> None:
    training = Training("bf16", "adam")
    assert training.state_per_byte(4) * training.param_bytes(4) == 16
    assert Training("fp32", "adam").state_per_byte(4, level=1, replicas=2) * 4 == 12
    assert Training().state_per_byte(2) == 2  # the profile's bytes, weights and gradients
    with pytest.raises(ConfigError, match="optimizer='lamb'"):
        Training(optimizer="lamb")


def test_a_layout_fills_the_workers_with_copies_and_recomputes_blocks() -> None:
    from dreampipe.profiling.devices import A100_80GB
    from dreampipe.profiling.gpt_spec import gpt_spec_profile, parse_gpt_spec

    spec = parse_gpt_spec("gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000")
    graph = gpt_spec_profile(spec, A100_80GB)
    topo = Topology.parse("dgx-a100:1")
    plain = plan_sync(graph, topo, SyncOptions(global_batch=64, layout=Layout(2, 2)))
    again = plan_sync(graph, topo, SyncOptions(global_batch=64, layout=Layout(2, 2,
                                                                              recompute_blocks=1)))
    assert (plain.tensor_parallel, plain.pipeline, plain.data_parallel) == (2, 2, 2)
    assert again.layout == "t2-p2-r1" and all(st.recomputed for st in again.stages)
    assert all(len({graph.layers[i].name.split(".")[0] for i in st.recomputed}) == 1
               for st in again.stages)
    with pytest.raises(PlanError, match="do not divide the global batch"):
        plan_sync(graph, topo, SyncOptions(global_batch=63, layout=Layout(2, 2)))


def test_recomputed_blocks_keep_their_inputs_and_one_blocks_tensors() -> None:
    """Blocks 0 and 1 (layers 1..12) recomputed keep, per microbatch held, their inputs
    instead of what their layers keep, and one block's kept tensors once."""
    from dreampipe.profiling.devices import A100_80GB
    from dreampipe.profiling.gpt_spec import gpt_spec_profile, parse_gpt_spec

    graph = gpt_spec_profile(parse_gpt_spec(
        "gpt:layers=3,hidden=256,heads=4,seq=128,vocab=1000"), A100_80GB)
    topo = Topology.parse("dgx-a100:1")
    tables = {k: SyncSearch(graph, topo, SyncOptions(global_batch=8, layout=Layout(
        1, 1, recompute_blocks=k))).tables(1, 1, 1, False) for k in (None, 2)}
    first, last, held = 1, 18, 3  # blocks 0..2, the first two recomputed
    kept = [graph.layers[i].stash_bytes for i in range(first, last + 1)]
    block = sum(kept[:6])
    saved = held * (2 * block - graph.cut_bytes()[7]) - block
    plain = tables[None].memory(0, held)[first, last]
    assert plain - tables[2].memory(0, held)[first, last] == pytest.approx(saved)
    forward = sum(graph.layers[i].forward_ms for i in range(first, 13)) / 1e3
    taus = [tables[k].times(0, 0)[0][first, last] for k in (2, None)]
    assert taus[0] - taus[1] == pytest.approx(forward)


@settings(max_examples=25, deadline=None)
@given(_graphs(), st.sampled_from(["2", "4", "2x2", "4x2"]), st.sampled_from([1e8, 1e10]),
       st.sampled_from([4, 8, 16]), st.sampled_from([None, 3 * 10**8]))
def test_the_objective_bounds_the_simulated_1f1b_flush(
        graph: LayerGraph, shape: str, bandwidth: float, batch: int, memory: int | None
) -> None:
    """Equal stages take the priced time (above); a pipeline's uneven stages, cuts and
    tails only end earlier than priced."""
    topo = Topology.parse(shape, [f"{bandwidth}B/s"] * len(shape.split("x")))
    try:
        found = plan_sync(graph, topo, SyncOptions(
            global_batch=batch, memory_bytes=memory, kinds=(PipelineKind.FLUSH,),
            recompute=True, tensor_split=False))
    except PlanError:
        return
    plan = found.plan()
    assert plan is not None
    took, _ = _simulated(graph, plan, topo, ScheduleKind.FLUSH, batch, found.microbatch_size)
    assert took <= found.time_per_update_s * (1 + 1e-9)


@settings(max_examples=25, deadline=None)
@given(st.one_of(_graphs(), _heavy_graphs()), st.sampled_from(["2", "4", "2x2", "4x2"]),
       st.sampled_from([1e8, 1e10]), st.sampled_from([4, 8, 16]),
       st.sampled_from([None, 3 * 10**8, 10**9]), st.sampled_from([(0,), None]))
def test_the_objective_bounds_the_simulated_zb_h1(
        graph: LayerGraph, shape: str, bandwidth: float, batch: int, memory: int | None,
        zero: tuple[int, ...] | None) -> None:
    """ZB-H1 credits each stage its own weight gradient, not the model's mix, so stages
    whose mix differs (ZeRO's gathers, recomputation) are priced no faster than they run;
    a wait for ZeRO-2's reduce-scatter in ``W`` fills no bubble."""
    topo = Topology.parse(shape, [f"{bandwidth}B/s"] * len(shape.split("x")))
    training = Training("bf16", "adam")
    try:
        found = plan_sync(graph, topo, SyncOptions(
            global_batch=batch, memory_bytes=memory, kinds=(PipelineKind.ZB_H1,),
            recompute=True, tensor_split=False, training=training, zero_levels=zero))
    except PlanError:
        return
    plan = found.plan()
    assert plan is not None
    took, _ = _simulated(training.trained(graph), plan, topo, ScheduleKind.ZB_H1, batch,
                         found.microbatch_size)
    assert took <= found.time_per_update_s * (1 + 1e-9)


def test_zb_h1_prices_a_stage_whose_gathers_lengthen_f_and_b_but_not_w() -> None:
    """ZeRO-3 gathers a stage's weights for its forward and its backward, not for its
    weight gradient: the stage's bubble grows, and the objective still bounds it."""
    topo = Topology.parse("dgx-a100:2")
    assert topo.device is not None
    graph = gpt_spec_profile(parse_gpt_spec("gpt:layers=8,hidden=4096,heads=32,seq=1024,"
                                            "vocab=8000"), topo.device)
    found = plan_sync(graph, topo, SyncOptions(
        global_batch=16, memory_bytes=8 * 10**9, kinds=(PipelineKind.ZB_H1,),
        layout=parse_layout("t1-p4-z3")))
    plan = found.plan()
    assert plan is not None and found.microbatches >= found.pipeline
    took, _ = _simulated(graph, plan, topo, ScheduleKind.ZB_H1, 16, found.microbatch_size)
    assert took <= found.time_per_update_s * (1 + 1e-9)
    assert took >= 0.95 * found.time_per_update_s


@pytest.mark.parametrize("layout", ["t2-p1", "t4-p1", "t2-p2"])
@pytest.mark.parametrize("b", [1, 16])
def test_split_stages_run_in_the_simulator_as_priced(layout: str, b: int) -> None:
    """A tensor-split stage's collectives keep their latency at any microbatch size, in
    its forward as in its ``tau``: the plan hands the simulator the forward the objective
    priced, so one stage simulates in its priced time and a pipeline no slower."""
    topo = Topology.parse("p3.16xlarge:1")
    assert topo.device is not None
    graph = gpt_spec_profile(parse_gpt_spec("gpt:layers=3,hidden=256,heads=4,seq=128,"
                                            "vocab=51200"), topo.device)
    found = plan_sync(graph, topo, SyncOptions(global_batch=64, microbatch_size=b,
                                               kinds=(PipelineKind.FLUSH,),
                                               layout=parse_layout(layout)))
    plan = found.plan()
    assert plan is not None and found.tensor_parallel > 1
    assert all(0 < st.forward_s < st.compute_s for st in plan.stages)
    took, _ = _simulated(graph, plan, topo, ScheduleKind.FLUSH, 64, b)
    assert took <= found.time_per_update_s * (1 + 1e-9)
    if found.pipeline == 1:
        assert took == pytest.approx(found.time_per_update_s, rel=1e-9)


def test_a_stage_without_a_backward_hands_on_a_forward_within_its_compute() -> None:
    """A stage's forward and compute come from separate sums, so where its layers have no
    backward the forward may round a unit above the compute; the plan holds it to the
    compute, which a runtime ``Stage`` requires."""
    layers = [Layer(f"l{i}", f, b, 10**6, 10**6 if b else 0, "Linear(4, 4)" if b else "ReLU()")
              for i, (f, b) in enumerate([(0.005474409113284237, 0.20320185246943334),
                                          (1 / 3, 0.0), (0.1, 0.2), (0.3, 0.0)])]
    graph = LayerGraph.chain(layers, batch_size=16, model="chain")
    found = plan_sync(graph, Topology.parse("dgx-a100:1"), SyncOptions(
        global_batch=64, layout=parse_layout("t1-p4"), kinds=(PipelineKind.FLUSH,)))
    plan = found.plan()
    assert plan is not None
    assert all(st.forward_s <= st.compute_s for st in plan.stages)
    assert plan.stages[1].forward_s == pytest.approx(plan.stages[1].compute_s)


@pytest.mark.parametrize(("kind", "layout"), [
    (PipelineKind.FLUSH, Layout(1, 4)), (PipelineKind.ZB_H1, Layout(1, 4)),
    (PipelineKind.INTERLEAVED, Layout(1, 2, 2)), (PipelineKind.INTERLEAVED, Layout(1, 4, 2))])
@pytest.mark.parametrize("batch", [4, 16])
def test_each_worker_holds_at_most_what_the_plan_prices(kind: PipelineKind, layout: Layout,
                                                        batch: int) -> None:
    """The simulator's peak of every worker, each microbatch in flight holding its own
    stage's activations, is within the memory the plan prices it at: ZB-H1 keeps a
    microbatch until its deferred ``W`` on every stage, and a worker of interleaved chunks
    holds at most the sum of its chunks' peaks."""
    graph = _chain([1.0, 3.0, 1.0, 2.0, 1.0, 4.0, 1.0, 2.0],
                   [10**7, 4 * 10**6, 10**6, 8 * 10**6, 2 * 10**6, 10**6, 3 * 10**6, 10**6],
                   [10**6] * 8, batch=4)
    topo = Topology.parse(str(layout.p), ["10GB/s"])
    found = plan_sync(graph, topo, SyncOptions(global_batch=batch, microbatch_size=1,
                                               kinds=(kind,), layout=layout,
                                               recompute=False, zero_levels=(0,)))
    plan = found.plan()
    assert plan is not None
    per = batch
    schedule = build_schedule([st.replicas for st in plan.stages], ScheduleKind(kind.value),
                              2 * per, per, virtual_stages=found.virtual_stages)
    result = simulate_schedule(schedule, costs_from_profile(graph, plan, topo, 1 / 4),
                               record_events=False)
    priced = [0.0] * layout.p
    for c, stage in enumerate(found.stages):
        priced[c % layout.p] += stage.memory_bytes
    for rank, peak in enumerate(result.peak_memory_bytes):
        assert peak <= priced[rank] * (1 + 1e-9), (rank, peak, priced)
    if kind is not PipelineKind.INTERLEAVED:  # one stage a worker: the same figure
        assert list(result.peak_memory_bytes) == pytest.approx(priced, rel=1e-9)

"""Megatron-LM's placement of whole blocks, and Megatron-LM's FLOP count of what a plan
runs: the blocks it recomputes, not the published run's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dreampipe.errors import ConfigError, PlanError
from dreampipe.planning.layout import parse_layout
from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_dp import whole_block_starts
from dreampipe.planning.sync_objective import PipelineKind
from dreampipe.planning.sync_search import SyncSearch, plan_sync
from dreampipe.planning.sync_stage_option import Recompute, layer_blocks
from dreampipe.planning.topology import Topology
from dreampipe.profiling.gpt_shapes import GptShape, blocks_recomputed
from dreampipe.profiling.gpt_spec import gpt_spec_profile, parse_gpt_spec
from dreampipe.profiling.graph import Layer, LayerGraph

SPEC = "gpt:layers=8,hidden=512,heads=8,seq=256,vocab=4096"


def test_whole_block_starts_put_the_embedding_first_and_the_head_last() -> None:
    blocks = (None, 0, 0, 1, 1, 2, 2, 3, 3, None, None)
    assert whole_block_starts(blocks, 1) == (0,)
    assert whole_block_starts(blocks, 2) == (0, 5)
    assert whole_block_starts(blocks, 4) == (0, 3, 5, 7)
    assert whole_block_starts(blocks, 3) is None  # 4 blocks do not split in 3
    assert whole_block_starts((None, None), 1) is None


@pytest.mark.parametrize("layout", ["t1-p4-r1", "t2-p2-v2-r2"])
def test_a_layout_of_whole_blocks_cuts_between_blocks_and_recomputes_them_whole(
        layout: str) -> None:
    topo = Topology.parse("dgx-a100:1")
    assert topo.device is not None
    graph = gpt_spec_profile(parse_gpt_spec(SPEC), topo.device)
    blocks = layer_blocks(graph)
    opts = SyncOptions(global_batch=16, microbatch_size=1, training=Training("bf16", "adam"),
                       layout=parse_layout(layout), whole_blocks=True,
                       kinds=(PipelineKind.FLUSH, PipelineKind.INTERLEAVED))
    found = plan_sync(graph, topo, opts)
    chunks = found.pipeline * found.virtual_stages
    starts = whole_block_starts(blocks, chunks)
    assert starts is not None
    assert tuple(st.first for st in found.stages) == starts
    per = 8 // chunks
    recompute = int(layout.rsplit("r", 1)[1])
    # every stage recomputes its first k blocks whole: k of its `per` blocks' layers
    assert blocks_recomputed(graph, found.recomputed_layers) == pytest.approx(
        chunks * min(recompute, per))
    free = plan_sync(graph, topo, replace(opts, whole_blocks=False))
    assert free.time_per_update_s <= found.time_per_update_s * (1 + 1e-9)


def test_the_count_follows_the_blocks_recomputed() -> None:
    shape = GptShape("x", 24, 2304, 24, 2048, 51200, 1)
    b, s, n, h, v = 512, 2048, 24, 2304, 51200
    published = 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    assert shape.update_flops(b) == pytest.approx(published, rel=1e-12)
    kept = shape.update_flops(b, 0)
    assert kept == pytest.approx(72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h)))
    assert shape.update_flops(b, 12) == pytest.approx((kept + published) / 2, rel=1e-12)
    with pytest.raises(ValueError, match="recomputed=25"):
        shape.update_flops(b, 25)


def _fixed(layout: str) -> tuple[LayerGraph, Topology, SyncOptions]:
    """``SPEC`` on one server, 8 microbatches of 1 an update, ``layout`` fixed, recomputing
    where only that fits, unsharded where the layout names no ZeRO level."""
    topo = Topology.parse("dgx-a100:1")
    assert topo.device is not None
    graph = gpt_spec_profile(parse_gpt_spec(SPEC), topo.device)
    return graph, topo, SyncOptions(global_batch=8, microbatch_size=1,
                                    training=Training("bf16", "adam"),
                                    layout=parse_layout(layout), recompute=True,
                                    zero_levels=None if parse_layout(layout).zero is not None
                                    else (0,))


def test_a_fixed_layout_may_recompute_every_block_one_at_a_time() -> None:
    """One stage whose whole forward, recomputed at once, does not fit, but block by block
    does: a layout without ``-r`` then recomputes every block (Megatron-LM's full
    recomputation), and without recomputation it does not fit at all."""
    graph, topo, opts = _fixed("t1-p1")
    search = SyncSearch(graph, topo, opts)
    tables = search.tables(1, 8, 1, False)
    last = len(graph) - 1
    need = {o.recompute: tables.memory_at(x, 1, 0, last) for x, o in enumerate(tables.options)}
    assert need[Recompute.BLOCKS] < need[Recompute.STAGE] <= need[Recompute.NONE]
    room = int((need[Recompute.BLOCKS] + need[Recompute.STAGE]) / 2)
    found = plan_sync(graph, topo, replace(opts, memory_bytes=room))
    assert [st.option.recompute for st in found.stages] == [Recompute.BLOCKS]
    assert blocks_recomputed(graph, found.recomputed_layers) == pytest.approx(8)
    assert found.layout == "t1-p1-r8"
    with pytest.raises(PlanError, match="fits in"):
        plan_sync(graph, topo, replace(opts, memory_bytes=room, recompute=False))
    # with room to keep everything it recomputes nothing
    free = plan_sync(graph, topo, opts)
    assert free.recomputed_layers == ()


def test_a_layout_says_r_only_where_every_stage_recomputes_its_blocks() -> None:
    found = plan_sync(*_fixed("t1-p2"))
    every = replace(found.stages[0], option=replace(found.stages[0].option,
                                                    recompute=Recompute.BLOCKS, blocks=8))
    keeps = replace(found.stages[1], option=replace(found.stages[1].option,
                                                    recompute=Recompute.NONE, blocks=0))
    assert replace(found, stages=(every, replace(keeps, option=every.option))).layout == (
        "t1-p2-r8")
    assert replace(found, stages=(every, keeps)).layout == "t1-p2"


def test_the_free_search_recomputes_block_by_block_only_when_asked() -> None:
    """Under a limit that no plan meets keeping its activations or recomputing stages
    whole, the free search asked to weigh block-by-block recomputation finds one that
    recomputes every block of a stage, within the limit; unasked, it says nothing fits.
    Asked, it searches a superset, so with room it is never slower."""
    topo = Topology.parse("dgx-a100:1")
    assert topo.device is not None
    graph = gpt_spec_profile(parse_gpt_spec(SPEC), topo.device)
    opts = SyncOptions(global_batch=8, training=Training("bf16", "adam"), recompute=True)
    room = 65 * 10**6
    with pytest.raises(PlanError, match="fits in"):
        plan_sync(graph, topo, replace(opts, memory_bytes=room))
    found = plan_sync(graph, topo, replace(opts, memory_bytes=room, recompute_blocks=True))
    assert Recompute.BLOCKS in {st.option.recompute for st in found.stages}
    assert max(st.memory_bytes for st in found.stages) <= room
    free = plan_sync(graph, topo, opts)
    asked = plan_sync(graph, topo, replace(opts, recompute_blocks=True))
    assert asked.time_per_update_s <= free.time_per_update_s * (1 + 1e-12)


def test_block_by_block_recomputation_needs_recomputation_and_blocks() -> None:
    with pytest.raises(ConfigError, match="recompute_blocks=True with recompute=False"):
        SyncOptions(global_batch=8, recompute_blocks=True)
    topo = Topology.parse("4x2")
    graph = LayerGraph.chain([Layer(f"l{i}", 1.0, 2.0, 10**6, 10**6) for i in range(4)])
    with pytest.raises(PlanError, match="no blocks"):
        plan_sync(graph, topo, SyncOptions(global_batch=8, recompute=True,
                                           recompute_blocks=True))


def test_whole_blocks_that_no_schedule_shares_evenly_say_so() -> None:
    """7 blocks cut into whole-block chunks only as 1 or 7: interleaving (p v >= 4 on 2 or
    more stages) has no plan, and the error says why and how to get one."""
    topo = Topology.parse("dgx-a100:1")
    assert topo.device is not None
    graph = gpt_spec_profile(parse_gpt_spec(SPEC.replace("layers=8", "layers=7")),
                             topo.device)
    with pytest.raises(PlanError, match=r"7 blocks share evenly only into 1, 7 stages.*"
                                        r"drop --whole-blocks"):
        plan_sync(graph, topo, SyncOptions(global_batch=48, whole_blocks=True,
                                           kinds=(PipelineKind.INTERLEAVED,)))

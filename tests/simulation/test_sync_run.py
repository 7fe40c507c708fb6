"""A saved synchronous plan simulated as it runs: each rank's peak memory is what the
planner priced for its stage, the optimizer's state and ZeRO's shards included."""

from __future__ import annotations

import pytest

from dreampipe.planning.layout import parse_layout
from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync import Sync
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_objective import PipelineKind
from dreampipe.planning.sync_search import plan_sync
from dreampipe.planning.topology import Topology
from dreampipe.profiling.load import load_graph
from dreampipe.simulation.sync_run import SyncRun, simulate_run

__all__: list[str] = []

_SHAPE = "gpt:layers=4,hidden=512,heads=8,seq=256,vocab=4000"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize(("precision", "zero"), [("bf16-mixed", 0), ("bf16", 0),
                                                 ("bf16-mixed", 1), ("bf16", 2)])
def test_each_rank_peaks_at_the_memory_its_stage_was_priced_at(
        optimizer: str, precision: str, zero: int) -> None:
    topo = Topology.parse("dgx-a100:1")
    graph = load_graph(_SHAPE, topo.device)
    training = Training(precision, optimizer)
    found = plan_sync(graph, topo, SyncOptions(
        global_batch=32, microbatch_size=1, training=training, recompute=False,
        layout=parse_layout(f"t1-p4-z{zero}"), kinds=(PipelineKind.FLUSH,)))
    plan = found.plan()
    assert plan is not None and found.data_parallel == 2
    _, result = simulate_run(SyncRun.of(found, training), plan, graph, topo, Sync(), 1)
    for rank, peak in enumerate(result.peak_memory_bytes):
        priced = found.stages[rank // found.data_parallel].memory_bytes
        assert peak == pytest.approx(priced, rel=1e-6), (rank, peak, priced)


@pytest.mark.parametrize("layout", ["t1-p1-r1", "t1-p1-r3", "t1-p2-r1", "t1-p2-r2",
                                    "t1-p4-r1", "t1-p2-z1-r1"])
def test_a_stage_recomputing_blocks_peaks_at_its_priced_memory(layout: str) -> None:
    """Under 1F1B-flush a stage recomputing its first blocks holds each block's input
    once (the layer before it keeps its output where it is not recomputed itself) and,
    while one backward recomputes, the largest such block's tensors once: the simulator
    and the planner count the same."""
    topo = Topology.parse("dgx-a100:1")
    graph = load_graph("gpt:layers=8,hidden=512,heads=8,seq=512,vocab=4000", topo.device)
    training = Training("bf16", "adam")
    found = plan_sync(graph, topo, SyncOptions(
        global_batch=16, microbatch_size=2, training=training, recompute=True,
        recompute_blocks=True, layout=parse_layout(layout), kinds=(PipelineKind.FLUSH,)))
    plan = found.plan()
    assert plan is not None and found.recomputed_layers
    _, result = simulate_run(SyncRun.of(found, training), plan, graph, topo, Sync(), 1)
    for rank, peak in enumerate(result.peak_memory_bytes):
        priced = found.stages[rank // found.data_parallel].memory_bytes
        assert peak == pytest.approx(priced, rel=1e-9), (rank, peak, priced)


def test_recomputing_one_block_of_one_microbatch_saves_and_costs_nothing() -> None:
    """One microbatch in flight: recomputing a block frees its tensors until its backward,
    which holds them again; its input is kept whether or not it recomputes."""
    topo = Topology.parse("dgx-a100:1")
    graph = load_graph("gpt:layers=4,hidden=512,heads=8,seq=512,vocab=4000", topo.device)
    memory = []
    for layout in ("t1-p1", "t1-p1-r1"):
        found = plan_sync(graph, topo, SyncOptions(
            global_batch=16, microbatch_size=2, training=Training("bf16", "adam"),
            layout=parse_layout(layout), kinds=(PipelineKind.FLUSH,), recompute=True,
            recompute_blocks=True))
        assert found.stages[0].held == 1
        memory.append(found.stages[0].memory_bytes)
    assert memory[1] == pytest.approx(memory[0], rel=1e-12)

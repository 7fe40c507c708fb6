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

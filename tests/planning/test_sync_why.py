"""Why each stage of a synchronous plan runs as it does: its options priced as the program
priced them, the one it runs among the fastest that fit and end the update in time."""

from __future__ import annotations

import pytest

from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_search import plan_sync
from dreampipe.planning.sync_why import stage_options
from dreampipe.planning.topology import Topology
from dreampipe.profiling.gpt_spec import gpt_spec_profile, parse_gpt_spec

SPEC = "gpt:layers=8,hidden=1024,heads=16,seq=1024,vocab=8192"


@pytest.mark.parametrize(("servers", "memory"),
                         [(1, None), (1, 10**9), (1, 5 * 10**8), (2, 5 * 10**8)])
def test_each_stage_runs_its_fastest_option_that_fits_and_ends_in_time(
        servers: int, memory: int | None) -> None:
    topo = Topology.parse(f"dgx-a100:{servers}")
    assert topo.device is not None
    graph = gpt_spec_profile(parse_gpt_spec(SPEC), topo.device)
    opts = SyncOptions(global_batch=64, memory_bytes=memory, recompute=True,
                       training=Training("bf16", "adam"))
    plan = plan_sync(graph, topo, opts)
    end = max(st.tail_s for st in plan.stages)
    choices = stage_options(graph, topo, opts, plan)
    assert len(choices) == len(plan.stages)
    for st, stage in zip(plan.stages, choices, strict=True):
        mine = [x for x in stage if x.chosen]
        assert len(mine) == 1 and mine[0].fits
        assert mine[0].tail_s == pytest.approx(st.tail_s)
        assert mine[0].memory_bytes == pytest.approx(st.memory_bytes)
        for x in stage:
            if x.fits and x.tail_s <= end:
                assert x.value_s >= mine[0].value_s * (1 - 1e-9), (x, mine[0])
    if memory is not None:  # the limit is what turns some option away
        assert any(not x.fits for stage in choices for x in stage)

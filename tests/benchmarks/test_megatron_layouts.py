"""``benchmarks/megatron_layouts.py``: Megatron-LM's layouts priced with its splits, beside
the planner, on a small GPT-style model."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from dreampipe.planning.splits import Split
from dreampipe.profiling.gpt_shapes import GptShape, gpt_profile


@pytest.fixture
def bench(import_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return import_benchmark("megatron_layouts")


def test_a_published_layout_runs_megatrons_splits_on_equal_blocks(bench: ModuleType) -> None:
    shape = GptShape("gpt-tiny", 4, 1024, 8, 256, 1000, 2)
    graph = gpt_profile(shape, bench.FLOPS)
    topo = bench.topology(2)
    plan = bench.price_layout(graph, shape, topo, bench.Layout(4, 2, 2, "test"))
    assert plan.config == "2t4-2t4"
    assert [(s.first, s.last) for s in plan.stages] == [(0, 12), (13, 26)]
    block = plan.stages[0].splits[1:7]  # ln1, attn_in, attn_out, ln2, fc1, fc2
    assert block == (Split.REPLICA, Split.OUT, Split.IN, Split.REPLICA, Split.OUT, Split.IN)
    # the table and the findings name every layout and the planner's plan
    case = bench.Case(shape, 2, (bench.Layout(4, 2, 2, "test"),))
    rows = bench.compute_row(case)
    assert [r.source for r in rows[1:]] == ["dreampipe plan", "dreampipe plan --memory 32GB"]
    # the planner tries Megatron's split (the fastest per width here): never slower
    assert rows[1].plan.time_per_minibatch_s <= rows[0].plan.time_per_minibatch_s * (1 + 1e-9)
    table = bench.render_table(rows)
    assert "`2t4-2t4`" in table and f"`{rows[1].plan.config}`" in table
    (finding,) = bench.findings(rows)
    assert finding.startswith("- gpt-tiny on 16 GPUs, (4, 2, 2): ")
    assert "fits 32 GB" in finding

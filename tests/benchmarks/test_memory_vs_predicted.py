"""``benchmarks/memory_vs_predicted.py``: the runs it trains and the rows it prints."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

__all__: list[str] = []


@pytest.fixture
def bench(import_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return import_benchmark("memory_vs_predicted")


def test_the_transformer_runs_every_precision_schedule_and_recomputation(
        bench: ModuleType) -> None:
    runs = [r for r in bench.RUNS if r.workload == "transformer"]
    assert len(runs) == 12 and len({r.flags for r in runs}) == 12
    for precision in ("fp32", "bf16-mixed", "bf16"):
        for schedule in ("pipedream", "1f1b-flush"):
            for blocks in ((), ("--recompute-blocks", "1")):
                flags = ("--schedule", schedule, *(("--microbatches", "4")
                                                    if schedule != "pipedream" else ()),
                         "--precision", precision, *blocks)
                assert sum(r.flags[-len(flags):] == flags for r in runs) == 1, flags
    assert all(r.flags[:7] == ("transformer", "--workers", "3", "--config", "2-1",
                               "--optimizer", "adam") for r in runs)
    assert {r.label for r in bench.RUNS if r.workload != "transformer"} == {
        "mlp stash on", "mlp stash off", "cnn stash on", "cnn stash off"}
    # the transformer's target, and tests/reliability/test_memory.py's quarter for the rest
    assert {r.tolerance for r in runs} == {0.15}
    assert {r.tolerance for r in bench.RUNS if r.workload != "transformer"} == {0.25}


def test_a_row_shows_the_median_of_its_runs_and_their_spread(bench: ModuleType) -> None:
    run = bench.RUNS[-1]
    rows = [{"rank": 2, "stage": 1, "predicted_bytes": 10e6, "measured_bytes": m,
             "ratio": m / 10e6} for m in (9e6, 12e6, 10.5e6)]
    line, off = bench.row_line(run, rows)
    assert line.split()[-2:] == ["1.05", "0.90-1.20"]
    assert off == pytest.approx(0.05) and "10.0 MB" in line and "10.5 MB" in line
    one, _ = bench.row_line(run, rows[:1])
    assert one.split()[-1] == "0.90"

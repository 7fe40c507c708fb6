"""``dreampipe bench``: timing windows, the report, the baselines' process runner."""

from __future__ import annotations

import json
import time

import pytest

from dreampipe.cli import main
from dreampipe.errors import BaselineError, DreampipeError, WorkerError
from dreampipe.jobs.baselines import Baseline, Workload
from dreampipe.jobs.bench import (
    BENCH_NAMES,
    BenchEntry,
    BenchOptions,
    BenchReport,
    format_table,
    run_bench,
    window_samples_per_s,
)
from dreampipe.runtime.launch import run_processes
from dreampipe.scheduling.actions import ActionKind
from dreampipe.scheduling.events import Event


def _pipeline_events(units: int, period: float, fill: float) -> list[Event]:
    """Two stages; stage 0's backward of unit u ends at fill + u * period."""
    out = []
    for u in range(units):
        end = fill + u * period
        out.append(Event(0, 0, ActionKind.FORWARD, u, u * 0.01, u * 0.01 + 0.001))
        out.append(Event(1, 1, ActionKind.BACKWARD, u, end - 0.02, end - 0.01))
        out.append(Event(0, 0, ActionKind.BACKWARD, u, end - 0.005, end))
    return out


def test_window_excludes_warmup_and_counts_timed_units() -> None:
    events = _pipeline_events(units=10, period=0.5, fill=3.0)
    rate = window_samples_per_s(events, warmup_units=4, total_units=10, unit_samples=32)
    # units 4..9 finish in the window from unit 3's end to unit 9's end: 6 periods
    assert rate == pytest.approx(6 * 32 / (6 * 0.5))
    whole = window_samples_per_s(events, warmup_units=0, total_units=10, unit_samples=32)
    assert whole == pytest.approx(10 * 32 / (3.0 + 9 * 0.5))
    assert whole < rate


def test_window_needs_the_boundary_backwards() -> None:
    events = _pipeline_events(units=3, period=0.5, fill=1.0)
    with pytest.raises(DreampipeError, match=r"unit\(s\) \[5\]"):
        window_samples_per_s(events, warmup_units=1, total_units=6, unit_samples=8)


def _report() -> BenchReport:
    entries = (
        BenchEntry("pipedream", 3000.0, 2800.0),
        BenchEntry("1f1b-flush", 2400.0, 2500.0),
        BenchEntry("torch-1f1b", 1600.0),
        BenchEntry("ddp", 2900.0),
    )
    return BenchReport(entries, BenchOptions(steps=5, warmup=1))


def test_report_json_and_ratios() -> None:
    data = json.loads(json.dumps(_report().to_json()))
    assert set(data["results"]) == {"pipedream", "1f1b-flush", "torch-1f1b", "ddp"}
    assert data["results"]["ddp"] == {"samples_per_s": 2900.0}
    assert data["results"]["pipedream"]["predicted_samples_per_s"] == 2800.0
    assert data["ratios"] == {
        "1f1b-flush/torch-1f1b": pytest.approx(2400.0 / 1600.0),
        "pipedream/torch-1f1b": pytest.approx(3000.0 / 1600.0),
    }


def test_table_lists_every_run_and_ratio() -> None:
    table = format_table(_report())
    for name in ("pipedream", "1f1b-flush", "torch-1f1b", "ddp"):
        assert any(line.startswith(name) for line in table.splitlines())
    assert "1f1b-flush / torch-1f1b: 1.50x" in table
    assert "gpipe / torch-gpipe" not in table


def test_workload_rejects_uneven_microbatches() -> None:
    with pytest.raises(DreampipeError, match="not divisible"):
        Workload(batch=250, microbatches=8)


def _fails(rank: int, world: int, arg: int) -> int:
    if rank == 1:
        raise ValueError(f"rank {rank} refuses {arg}")
    return rank


def _sleeps(rank: int, world: int, arg: float) -> None:
    time.sleep(arg)


def _rank_times(rank: int, world: int, arg: int) -> int:
    return rank * arg + world


def test_processes_return_results_by_rank() -> None:
    assert run_processes(_rank_times, 2, 10, deadline_s=60) == [2, 12]


def test_child_traceback_is_surfaced() -> None:
    with pytest.raises(BaselineError, match=r"(?s)rank 1.*ValueError: rank 1 refuses 7"):
        run_processes(_fails, 2, 7, deadline_s=60, error=BaselineError)
    with pytest.raises(WorkerError, match=r"(?s)rank 1 failed.*refuses 8"):
        run_processes(_fails, 2, 8, deadline_s=60)


def test_deadline_stops_every_child() -> None:
    start = time.monotonic()
    with pytest.raises(BaselineError, match="deadline"):
        run_processes(_sleeps, 1, 60.0, deadline_s=3, error=BaselineError)
    assert time.monotonic() - start < 20


def test_bench_cli_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    names = ["torch-1f1b", "ddp", "single-1thread"]
    status = main(["bench", "--only", *names, "--steps", "2", "--warmup", "1", "--json",
                   "--no-progress", "--rounds", "1"])
    assert status == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["results"]) == set(names)
    for name in names:
        assert data["results"][name]["samples_per_s"] > 0


def test_every_bench_name_has_a_runner_and_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    import dreampipe.jobs.bench as bench

    ran: list[str] = []

    def baseline(which: Baseline, work: object, *, timeout_s: float) -> float:
        ran.append(which.value)
        return 1.0

    def dreampipe(shape: bench._Shape, work: object, timeout_s: float) -> float:
        ran.append(shape.layout.kind.value)
        return 2.0

    def predict(shapes: list[bench._Shape], work: object) -> dict[object, float]:
        return {sh.layout.kind: 3.0 for sh in shapes}

    monkeypatch.setattr(bench, "run_baseline", baseline)
    monkeypatch.setattr(bench, "_run_dreampipe", dreampipe)
    monkeypatch.setattr(bench, "_predict", predict)
    report = run_bench(BenchOptions(progress=False, rounds=1))
    assert ran == list(BENCH_NAMES), "every name runs once, in order, by its own runner"
    assert list(report.to_json()["results"]) == list(BENCH_NAMES)
    rows = format_table(report).splitlines()[2:2 + len(BENCH_NAMES)]
    assert [row.split()[0] for row in rows] == list(BENCH_NAMES)


def test_bench_cli_rejects_bad_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--steps", "0"]) == 2
    assert "--steps 0" in capsys.readouterr().err


def test_rounds_interleave_and_report_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    import dreampipe.jobs.bench as bench

    calls: list[str] = []
    rates = {"ddp": iter([1.0, 5.0, 3.0]), "single-1thread": iter([9.0, 7.0, 8.0])}

    def fake(which: Baseline, work: object, *, timeout_s: float) -> float:
        calls.append(which.value)
        return next(rates[which.value])

    monkeypatch.setattr(bench, "run_baseline", fake)
    report = run_bench(BenchOptions(progress=False, rounds=3), ["ddp", "single-1thread"])
    assert calls == ["ddp", "single-1thread"] * 3
    assert [(e.name, e.samples_per_s) for e in report.entries] == [
        ("ddp", 3.0), ("single-1thread", 8.0)]
    assert report.to_json()["rounds"] == 3

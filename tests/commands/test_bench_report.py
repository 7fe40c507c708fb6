"""``commands.bench_report``: a report of fabricated rounds shows each run's median and
spread, each ratio of two runs that both ran, and the same figures in its JSON."""

from __future__ import annotations

import json
import re
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.commands.bench_names import BENCH_NAMES, LLAMA_RUN_NAMES
from dreampipe.commands.bench_report import RATIOS, BenchEntry, BenchReport, format_table
from dreampipe.commands.workloads import Workload, WorkloadKind

__all__: list[str] = []

_WORK = Workload(steps=7, warmup=2)
_RATIO_LINE = re.compile(r"  (\S+) / (\S+) +([\d.]+)x \(([\d.]+)-([\d.]+)\)  (.+)")
_RATE = st.floats(1.0, 1e5, allow_nan=False, allow_infinity=False)


@st.composite
def _reports(draw: st.DrawFn) -> BenchReport:
    """Some of the bench's runs, in its order, each with the same number of rounds."""
    names = [n for n in BENCH_NAMES if draw(st.booleans())]
    rounds = draw(st.integers(1, 5))
    entries = []
    for name in names:
        rates = tuple(draw(st.lists(_RATE, min_size=rounds, max_size=rounds)))
        predicted = draw(st.none() | _RATE)
        entries.append(BenchEntry(name, rates, draw(st.integers(1, 512)), predicted))
    return BenchReport(tuple(entries), _WORK)


@settings(max_examples=60, deadline=None)
@given(rates=st.lists(_RATE, min_size=1, max_size=9), data=st.data())
def test_an_entrys_rate_is_the_median_of_its_rounds(rates: list[float],
                                                    data: st.DataObject) -> None:
    median = BenchEntry("ddp", tuple(rates), 1).samples_per_s
    shuffled = data.draw(st.permutations(rates))
    assert BenchEntry("ddp", tuple(shuffled), 1).samples_per_s == median, "order is no matter"
    assert 2 * sum(r <= median for r in rates) >= len(rates)
    assert 2 * sum(r >= median for r in rates) >= len(rates)
    assert BenchEntry("ddp", (1.0, 2.0, 3.0, 10.0), 1).samples_per_s == 2.5


@settings(max_examples=60, deadline=None)
@given(report=_reports())
def test_ratios_pair_medians_of_runs_that_both_ran_with_same_round_spreads(
    report: BenchReport,
) -> None:
    ran = {e.name: e for e in report.entries}
    want = [(run, base) for run, base, _ in RATIOS if run in ran and base in ran]
    got = report.ratios()
    assert [(r.run, r.baseline) for r in got] == want
    for r in got:
        a, b = ran[r.run], ran[r.baseline]
        assert r.value == pytest.approx(statistics.median(a.rounds) / statistics.median(b.rounds))
        paired = [x / y for x, y in zip(a.rounds, b.rounds, strict=True)]
        assert (r.low, r.high) == pytest.approx((min(paired), max(paired)))
        assert r.key == f"{r.run}/{r.baseline}"


def test_a_baseline_that_never_ran_gives_no_ratio_and_an_idle_round_no_spread() -> None:
    report = BenchReport((BenchEntry("pipedream", (10.0, 30.0, 20.0), 128),
                          BenchEntry("ddp", (0.0, 0.0, 0.0), 128)), _WORK)
    assert report.ratios() == []
    report = BenchReport((BenchEntry("pipedream", (10.0, 30.0, 20.0), 128),
                          BenchEntry("ddp", (0.0, 10.0, 40.0), 128)), _WORK)
    [ratio] = report.ratios()
    assert (ratio.value, ratio.low, ratio.high) == (2.0, 0.5, 3.0)


@settings(max_examples=40, deadline=None)
@given(report=_reports())
def test_the_json_holds_every_run_and_ratio_and_reads_back_the_same(report: BenchReport) -> None:
    data = report.to_json()
    assert json.loads(json.dumps(data)) == data
    assert (data["workload"], data["steps"], data["warmup"]) == ("mlp", 7, 2)
    assert data["rounds"] == max((len(e.rounds) for e in report.entries), default=0)
    assert list(data["results"]) == [e.name for e in report.entries]
    for e in report.entries:
        row = data["results"][e.name]
        assert row["rounds"] == list(e.rounds)
        assert (row["samples_per_s"], row["min"], row["max"]) == (
            statistics.median(e.rounds), min(e.rounds), max(e.rounds))
        assert row.get("predicted_samples_per_s") == e.predicted_samples_per_s
    ratios = report.ratios()
    assert data["ratios"] == {r.key: r.value for r in ratios}
    assert data["ratio_ranges"] == {r.key: [r.low, r.high] for r in ratios}


@settings(max_examples=40, deadline=None)
@given(report=_reports())
def test_the_table_shows_each_runs_median_spread_and_prediction_then_each_ratio(
    report: BenchReport,
) -> None:
    """Each figure as printed is within half its last digit (and a hair) of the report's."""
    lines = format_table(report).splitlines()
    assert lines[0] == _WORK.describe()
    assert lines[1].startswith("7 timed updates after 2 warm-up")
    assert f"median and min-max of {report.rounds} interleaved rounds" in lines[1]
    rows = lines[3:3 + len(report.entries)]
    for e, row in zip(report.entries, rows, strict=True):
        cells = row.split()
        assert cells[:2] == [e.name, str(e.microbatch_size)]
        assert float(cells[2]) == pytest.approx(e.samples_per_s, abs=0.051)
        spread = tuple(map(float, cells[3].split("-")))
        assert spread == pytest.approx((min(e.rounds), max(e.rounds)), abs=0.51)
        pred = e.predicted_samples_per_s
        if pred is None:
            assert len(cells) == 4
        else:
            assert float(cells[4]) == pytest.approx(pred, abs=0.051)
            assert float(cells[5]) == pytest.approx(e.samples_per_s / pred, abs=0.0051)
    rest = lines[3 + len(report.entries):]
    ratios = report.ratios()
    assert rest[:1] == (["ratios of medians (min-max of the same-round ratios):"] if ratios
                        else [])
    assert len(rest) == (len(ratios) + 1 if ratios else 0)
    for r, line in zip(ratios, rest[1:], strict=True):
        found = _RATIO_LINE.fullmatch(line)
        assert found is not None, line
        run, base, value, low, high, about = found.groups()
        assert (run, base, about) == (r.run, r.baseline, r.about)
        assert (float(value), float(low), float(high)) == pytest.approx((r.value, r.low, r.high),
                                                                         abs=0.0051)


def test_the_v_shaped_runs_and_the_llamas_pair_with_pytorchs_same_schedule() -> None:
    """``zbv / torch-zbv`` and ``dualpipev / torch-dualpipev`` print as the other pairs do;
    the llama's default runs give its three pairs and nothing else."""
    pairs = [(run, base) for run, base, _ in RATIOS]
    assert ("zbv", "torch-zbv") in pairs and ("dualpipev", "torch-dualpipev") in pairs
    rates = {"zbv": (30.0, 20.0, 10.0), "torch-zbv": (10.0, 10.0, 10.0),
             "dualpipev": (12.0, 9.0, 6.0), "torch-dualpipev": (6.0, 6.0, 4.0)}
    table = format_table(BenchReport(tuple(BenchEntry(n, r, 2) for n, r in rates.items()),
                                     _WORK))
    lines = [m.groups()[:5] for m in map(_RATIO_LINE.fullmatch, table.splitlines()) if m]
    assert lines == [("zbv", "torch-zbv", "2.00", "1.00", "3.00"),
                     ("dualpipev", "torch-dualpipev", "1.50", "1.50", "2.00")]
    llama = BenchReport(tuple(BenchEntry(n, (1.0,), 2) for n in LLAMA_RUN_NAMES),
                        Workload.of(WorkloadKind.LLAMA))
    assert [(r.run, r.baseline) for r in llama.ratios()] == [
        ("1f1b-flush", "torch-1f1b"), ("zb-h1", "torch-zb"),
        ("interleaved-1f1b", "torch-interleaved-1f1b")]

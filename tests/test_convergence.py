"""``benchmarks/convergence.py``: the quick study as CI runs it, and the committed report."""

from __future__ import annotations

import importlib
import itertools
import json
import math
from pathlib import Path
from types import ModuleType

import pytest

__all__: list[str] = []

_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(_ROOT / "benchmarks"))
    return importlib.import_module("convergence")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_quick_study_records_every_run_resumes_and_reports(
        bench: ModuleType, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "quick.json"
    argv = ["--quick", "--results", str(results), "--docs", str(tmp_path), "--timeout", "200"]
    bench.main(argv)
    data = json.loads(results.read_text())
    study = bench.QUICK
    assert set(data["runs"]) == {f"{w}/{v}/{g.workers}/{s}" for g in study.groups
                                 for w in g.workloads for v in g.variants
                                 for s in study.seeds}
    assert {w for g in study.groups for w in g.workloads} == {w.value for w in bench.Workload}
    for key, run in data["runs"].items():
        evaluations = study.epochs[run["workload"]] + 1
        assert len(run["seconds"]) == len(run["test_loss"]) == evaluations, key
        assert all(b > a for a, b in itertools.pairwise(run["seconds"])), (key, run["seconds"])
        assert all(math.isfinite(x) and x > 0 for x in run["test_loss"] + run["train_loss"][1:])
        accuracy = run["test_accuracy"]
        if run["workload"] in ("digits", "mlp"):
            assert all(0 <= a <= 1 for a in accuracy), (key, accuracy)
        else:
            assert accuracy == [None] * evaluations, key
    for workload in bench.Workload:
        assert (tmp_path / f"convergence-{workload.value}.png").read_bytes()[:4] == b"\x89PNG"
    doc = (tmp_path / "convergence.md").read_text()
    assert "| digits | 2 | 2bw |" in doc and "| chars | 2 | dp |" in doc, doc
    capfd.readouterr()
    bench.main(argv)
    assert "0 runs to do" in capfd.readouterr().out
    assert json.loads(results.read_text()) == data


def test_the_committed_table_is_written_from_the_committed_results(bench: ModuleType) -> None:
    import convergence_report

    data = json.loads((_ROOT / "docs" / "convergence.json").read_text())
    assert data["study"] == bench.STUDY.header()
    doc = (_ROOT / "docs" / "convergence.md").read_text()
    assert convergence_report.table(data) in doc, "run python benchmarks/convergence.py --report"


def test_the_planner_s_study_rows_are_written_from_the_committed_results(
        bench: ModuleType, tmp_path: Path) -> None:
    """``semantics="any"`` reads the study's epochs to target from the package: they are
    what the committed results give, and writing them again changes nothing."""
    import convergence_report

    from dreampipe.runplan import study_epochs

    data = json.loads((_ROOT / "docs" / "convergence.json").read_text())
    text = convergence_report.study_rows(data)
    assert text in convergence_report.ROWS_MODULE.read_text(), (
        "run python benchmarks/convergence.py --report")
    assert len(study_epochs.ROWS) == text.count("StudyRow(") > 0
    copy = tmp_path / "study_epochs.py"
    copy.write_text(convergence_report.ROWS_MODULE.read_text())
    assert convergence_report.write_rows(data, copy).read_text() == \
        convergence_report.ROWS_MODULE.read_text()


def test_the_link_section_is_written_from_the_committed_link_results(bench: ModuleType) -> None:
    """The shaped-link study: its runs make the loopback study's updates (``section``
    checks every held-out loss against them), at the settings it declares, and the page
    shows what its results give."""
    import convergence_link

    loopback = json.loads((_ROOT / "docs" / "convergence.json").read_text())
    studies = convergence_link.link_studies(_ROOT / "docs")
    assert {d["link"] for d in studies} >= {None}, "run the study over an unshaped link too"
    assert len(studies) >= 2, "the study needs a shaped rate beside the unshaped link"
    for d in studies:
        assert d["study"] == convergence_link.LINK.header()
        assert len(d["runs"]) == len(convergence_link.LINK.seeds) * len(
            convergence_link.LINK.groups[0].variants), d["link"]
    doc = (_ROOT / "docs" / "convergence.md").read_text()
    assert convergence_link.section(loopback, studies) in doc, (
        "run python benchmarks/convergence_link.py --report")


def test_a_link_run_whose_updates_differ_from_loopback_is_refused(bench: ModuleType) -> None:
    import copy

    import convergence_link

    loopback = json.loads((_ROOT / "docs" / "convergence.json").read_text())
    study = copy.deepcopy(convergence_link.link_studies(_ROOT / "docs")[0])
    run = next(iter(study["runs"].values()))
    run["test_loss"][3] *= 1.001
    with pytest.raises(SystemExit, match="the link changed the updates"):
        convergence_link.section(loopback, [study])

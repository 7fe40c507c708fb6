"""``benchmarks/_docs.py``: sections of docs/benchmarks.md replaced between their markers."""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

__all__: list[str] = []

_WHEN = datetime.datetime(2030, 1, 2, 3, 4, tzinfo=datetime.UTC)


@pytest.fixture
def docs(import_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return import_benchmark("_docs")


def test_a_block_is_replaced_whole_and_the_rest_kept(docs: ModuleType) -> None:
    text = "intro\n<!-- begin a -->\nold\nlines\n<!-- end a -->\noutro\n"
    assert docs.replace_block(text, "a", "new") == \
        "intro\n<!-- begin a -->\nnew\n<!-- end a -->\noutro\n"
    with pytest.raises(ValueError, match="begin b"):
        docs.replace_block(text, "b", "new")


def test_a_missing_page_is_created_with_every_section_and_one_is_filled(
        docs: ModuleType, tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    docs.write_section("planner", "model  plan s\nvgg16  0.010 ±0.001\n",
                       "python benchmarks/bench_planner.py --repeat 3", path=page, now=_WHEN)
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nThis page is generated")
    for s in docs.SECTIONS:
        assert text.count(f"<!-- begin {s.name} -->") == 1, s.name
        assert f"`{s.command}`" in text
    planner = text.split("<!-- begin planner -->")[1].split("<!-- end planner -->")[0]
    assert "`python benchmarks/bench_planner.py --repeat 3` on " in planner
    assert "torch " in planner and "2030-01-02 03:04 UTC" in planner
    assert "```text\nmodel  plan s\nvgg16  0.010 ±0.001\n```" in planner
    docs.write_section("planner", "second", "cmd", path=page, now=_WHEN)
    again = page.read_text()
    assert "vgg16" not in again and "```text\nsecond\n```" in again
    assert again.count("Not generated yet") == len(docs.SECTIONS) - 1
    with pytest.raises(ValueError, match="SECTIONS"):
        docs.write_section("nope", "x", "cmd", path=page)


def test_capture_tees_stdout_and_finish_writes_the_printed_table(
        docs: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "benchmarks.md"
    monkeypatch.setattr(docs, "DOCS", page)
    monkeypatch.setattr(docs, "_ROOT", tmp_path)
    parser = argparse.ArgumentParser()
    docs.add_argument(parser)
    assert docs.capture(parser.parse_args([])) is None
    stdout = sys.stdout
    tee = docs.capture(parser.parse_args(["--write-docs"]))
    print("a table row")
    docs.finish(tee, "simulator", "benchmarks/bench_simulator.py", ["--repeat", "2",
                                                                      "--write-docs"])
    assert sys.stdout is stdout
    assert "a table row" in capsys.readouterr().out
    section = page.read_text().split("<!-- begin simulator -->")[1]
    assert section.startswith("\n`python benchmarks/bench_simulator.py --repeat 2` on ")
    assert "```text\na table row\n```" in section

"""``benchmarks/megatron_sc21.py``: SC21's Table 1 priced with its published layouts, and
its section of docs/megatron.md as the script prints it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from dreampipe.profiling.devices import A100_80GB

_PAGE = Path(__file__).resolve().parents[2] / "docs" / "megatron.md"


@pytest.fixture
def bench(import_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return import_benchmark("megatron_sc21")


def _rows(text: str, name: str) -> list[str]:
    """The table lines of row ``name``, their last cell (a time) dropped."""
    return [line.rsplit("|", 2)[0] for line in text.splitlines()
            if line.startswith(f"| {name} |")]


def test_every_published_layout_runs_its_batch_as_megatron_lm_requires(
        bench: ModuleType) -> None:
    assert len(bench.ROWS) == 10 and len(bench.TABLE_2) == 12
    for row in (*bench.ROWS, *bench.TABLE_2):
        d = row.gpus // (row.t * row.p)
        assert d * row.t * row.p == row.gpus, row.name
        assert row.batch % (d * row.microbatch) == 0, row.name
        m = row.batch // (d * row.microbatch)
        assert row.v == 1 or m % row.p == 0, row.name  # interleaving: m a multiple of p
        assert row.layers % (row.p * row.v) == 0, row.name
    assert bench.ROWS[6].layout.text == "t8-p8-v2-r5"  # 145.6B: 5 blocks a chunk
    # Table 2: ZeRO-3 runs every GPU as a replica of the whole model, one microbatch each
    zero = [row for row in bench.TABLE_2 if row.zero]
    assert len(zero) == 6 and all(row.batch == row.gpus * row.microbatch for row in zero)
    assert zero[0].layout.text == "t1-p1-v1-z3-r96"


def test_the_fit_reproduces_its_row_and_the_docs_show_what_the_script_prints(
        bench: ModuleType) -> None:
    rate = bench.fit_rate()
    # the A100 preset's products run at this fit: re-fit it when the cost model moves it
    assert rate == pytest.approx(A100_80GB.sustained_flops, rel=1e-3)
    small, tensor = bench.ROWS[0], bench.ROWS[1]
    priced = [bench.price(small, rate), bench.price(tensor, rate)]
    assert priced[0].ratio == pytest.approx(1.0, abs=1e-5)
    assert priced[1].plan.tensor_parallel == 2 and priced[1].plan.data_parallel == 32
    # the planner's own search takes a minute or more here: the suite checks its time cap
    own = [bench.own_plan(row, rate, 1e-3) for row in (small, tensor)]
    assert own == [{"timeout": 1e-3}] * 2
    printed = bench.render_tables(priced, own)
    assert "not found in 0 s" in printed
    page = _PAGE.read_text()
    section = page.split("<!-- begin sc21 -->")[1].split("<!-- end sc21 -->")[0]
    assert page.index(bench.HEADING) < page.index("<!-- begin sc21 -->")
    assert f"{rate / 1e12:.1f} TFLOP/s" in section
    for name in (small.name, tensor.name):
        mine, docs = _rows(printed, name), _rows(section, name)
        assert mine[0] == docs[0], name  # the prediction, cell by cell


def test_the_layouts_page_keeps_the_sc21_section(
        import_benchmark: Callable[[str], ModuleType], tmp_path: Path) -> None:
    layouts = import_benchmark("megatron_layouts")
    sc21 = import_benchmark("megatron_sc21")
    page = tmp_path / "megatron.md"
    assert layouts.keep_sc21("# new\n", page) == "# new\n"
    page.write_text("# old\n\nold text\n")
    sc21.write("the rows", page)
    assert "<!-- begin sc21 -->\nthe rows\n<!-- end sc21 -->" in page.read_text()
    kept = layouts.keep_sc21("# new\n", page)
    assert kept.startswith("# new\n\n" + sc21.HEADING) and "old text" not in kept
    assert "the rows" in kept

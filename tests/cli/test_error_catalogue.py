"""Every catalogued bad input: exit 2, one line, no worker started; docs/errors.md current."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dreampipe.cli import main
from tests.cli.error_catalogue import CASES, Case, Outcome, render, run_case

_DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    """Every case run once, with anything that would start workers made to fail loudly."""
    import torch.distributed as dist

    import dreampipe.commands.bench_process as bench_process
    import dreampipe.commands.train_run as train

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("a bad input reached the point of starting workers")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "init_process_group", refuse)
        mp.setattr(train, "run_processes", refuse)
        mp.setattr(bench_process, "run_processes", refuse)
        return {case.id: run_case(case, main) for case in CASES}


def test_the_catalogue_holds_at_least_25_distinct_cases() -> None:
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_is_one_line_naming_it_with_exit_2(
    case: Case, outcomes: dict[str, Outcome]
) -> None:
    got = outcomes[case.id]
    command = case.argv[0]
    assert got.code == 2, got
    assert got.out == "", got.out
    assert got.err.startswith(f"dreampipe {command}: error: "), got.err
    assert got.err.count("\n") == 1 and "Traceback" not in got.err, got.err
    for needle in case.needles:
        assert needle in got.err, (needle, got.err)


def test_docs_errors_md_is_generated_from_the_catalogue(outcomes: dict[str, Outcome]) -> None:
    assert _DOC.read_text() == render(outcomes), (
        "docs/errors.md is stale; run: python tests/cli/error_catalogue.py"
    )

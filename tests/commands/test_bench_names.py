"""``commands.bench_names``: every bench run named once, in order, without loading torch."""

from __future__ import annotations

import subprocess
import sys

from dreampipe.commands.bench_names import (
    BENCH_NAMES,
    DREAMPIPE_RUN_NAMES,
    LLAMA_RUN_NAMES,
    Baseline,
    WorkloadKind,
    default_runs,
)

__all__: list[str] = []


def test_the_bench_runs_dreampipes_runs_then_the_baselines_each_named_once() -> None:
    assert len(set(BENCH_NAMES)) == len(BENCH_NAMES)
    assert BENCH_NAMES[:len(DREAMPIPE_RUN_NAMES)] == DREAMPIPE_RUN_NAMES
    assert [Baseline(n) for n in BENCH_NAMES[len(DREAMPIPE_RUN_NAMES):]] == list(Baseline)
    assert {k.value for k in WorkloadKind} == {"mlp", "transformer", "llama"}


def test_the_llama_runs_dreampipes_1f1b_zero_bubble_and_interleaved_and_pytorchs() -> None:
    """Each of dreampipe's three against PyTorch's same schedule, in the bench's order."""
    assert default_runs(WorkloadKind.LLAMA) == LLAMA_RUN_NAMES == (
        "1f1b-flush", "zb-h1", "interleaved-1f1b", "torch-1f1b", "torch-zb",
        "torch-interleaved-1f1b")
    assert [n for n in BENCH_NAMES if n in LLAMA_RUN_NAMES] == list(LLAMA_RUN_NAMES)
    assert default_runs(WorkloadKind.MLP) == default_runs(WorkloadKind.TRANSFORMER) == BENCH_NAMES
    assert {"zbv", "dualpipev"} <= set(DREAMPIPE_RUN_NAMES)
    assert {Baseline("torch-zbv"), Baseline("torch-dualpipev")} <= set(Baseline)


def test_every_name_has_a_run_behind_it() -> None:
    from dreampipe.commands.bench_runs import DREAMPIPE_RUNS

    assert tuple(DREAMPIPE_RUNS) == DREAMPIPE_RUN_NAMES


def test_the_names_load_without_torch() -> None:
    """The CLI's parser lists them; ``dreampipe --help`` must not wait for PyTorch."""
    code = ("import sys, dreampipe.commands.bench_names; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

"""``benchmarks/gpu_check.py``: which steps run where, and its device step on the CPU."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

__all__: list[str] = []



@pytest.fixture
def check(import_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return import_benchmark("gpu_check")


@pytest.mark.parametrize("gpus", [0, 1, 2, 8])
def test_ranks_use_the_gpus_only_when_each_rank_has_one(check: ModuleType, gpus: int) -> None:
    steps = {s.name: s for s in check.plan_steps(gpus)}
    assert list(steps) == list(check.STEPS)
    for name in ("cuda", "pipeline"):  # one GPU is enough
        assert (steps[name].command is None) == (gpus == 0), name
        assert not steps[name].hide_gpus
    assert (steps["bench"].command is None) == (gpus > 0)  # CPU pipelines: no GPU time
    for name in ("equivalence", "train", "memory"):
        # two ranks need two GPUs; with one, the step would only repeat the CPU's run
        assert (steps[name].command is None) == (gpus == 1), name
        assert steps[name].hide_gpus == (gpus < 2), name
    assert sum(s.timeout_s for s in steps.values() if s.command) <= 600  # one device call


def test_the_device_step_profiles_and_measures_on_the_cpu(
        check: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert check.device_check(torch.device("cpu")) == 0
    out = capsys.readouterr().out
    assert "forward ms" in out and "peak memory above the baseline (cpu)" in out


def test_a_step_past_its_limit_fails_and_takes_its_processes_with_it(
        check: ModuleType, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    step = check.Step("slow", ("sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"), "here",
                      timeout_s=1.0)
    assert check._run(step) == "FAILED: over 1 s"
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        status = Path(f"/proc/{grandchild}/status")
        if not status.exists() or "State:\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the step's process {grandchild} outlived it")


@pytest.mark.parametrize(("name", "code", "verdict"), [
    ("train", 0, "passed"), ("train", 3, "ran"), ("train", 1, "FAILED"), ("memory", 3, "FAILED"),
])
def test_a_prediction_off_its_tolerance_is_a_figure_not_a_failure(
        check: ModuleType, name: str, code: int, verdict: str) -> None:
    assert check.OUTSIDE_TOLERANCE == 3
    step = check.Step(name, (check.sys.executable, "-c", f"raise SystemExit({code})"), "here", 30)
    assert check._run(step).startswith(verdict)

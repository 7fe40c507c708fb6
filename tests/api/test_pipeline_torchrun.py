"""A user's script on the public API under ``torchrun --nproc-per-node 2``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torchrun import torchrun_json

from . import user_script as us

__all__: list[str] = []


def _torchrun(schedule: str, out: Path, *extra: str) -> dict[str, Any]:
    return torchrun_json(Path(__file__).with_name("user_script.py"), schedule, str(out), *extra)


def _single_process() -> dict[str, torch.Tensor]:
    """The same updates in one process: AdamW on the mean loss, accumulated over microbatches."""
    model = us.build_model()
    opt = us.optimizer(list(model.parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, us.warmup)
    size = us.BATCH // us.MICRO
    for x, y in us.batches(us.STEPS):
        opt.zero_grad()
        for m in range(us.MICRO):
            part = slice(m * size, (m + 1) * size)
            (F.cross_entropy(model(x[part]), y[part]) / us.MICRO).backward()
        opt.step()
        sched.step()
    return model.state_dict()


@pytest.mark.timeout(120)
def test_user_script_with_1f1b_flush_equals_a_single_process_run(tmp_path: Path) -> None:
    got = _torchrun("1f1b-flush", tmp_path / "w.pt", "--straight")
    losses = got["losses"]
    assert isinstance(losses, list) and len(losses) == us.STEPS
    assert sum(losses[-3:]) < sum(losses[:3])
    state = torch.load(tmp_path / "w.pt")
    want = _single_process()
    assert sorted(state) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=4e-5, msg=k)


@pytest.mark.timeout(120)
def test_user_script_with_pipedream_and_an_auto_plan_learns(tmp_path: Path) -> None:
    # the plan is measured, so its cuts, and the delays they give, vary from run to run;
    # twice the steps of the equivalence test let any of them show that it learns
    steps = 2 * us.STEPS
    got = _torchrun("pipedream", tmp_path / "w.pt", "--steps", str(steps))
    losses = got["losses"]
    assert isinstance(losses, list) and len(losses) == steps
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3])
    assert sorted(torch.load(tmp_path / "w.pt")) == sorted(us.build_model().state_dict())

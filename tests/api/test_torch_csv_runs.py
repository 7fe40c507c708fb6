"""Schedules exchanged with PyTorch's pipelining train as one process does, on both sides.

PyTorch's ScheduleInterleaved1F1B and ScheduleZBVZeroBubble (2 ranks, 4 stages, 8
microbatches), as its ``_dump_csv`` writes them, train in dreampipe's Pipeline through
``schedule_file``;
dreampipe's zb-h1 as ``write_torch_csv`` writes it runs a step in PyTorch's own
``_PipelineScheduleRuntime``. Both in one launch of 2 processes over gloo, each against
one process (:func:`schedule_workers.reference`, :func:`torch_csv_workers.torch_reference`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

import dreampipe
from dreampipe.errors import ConfigError
from dreampipe.runtime.processes import run_processes
from dreampipe.scheduling.actions import Action, ActionKind, ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.torch_csv_write import write_torch_csv

from .compare import ATOL, RTOL, assert_matches
from .schedule_workers import reference
from .torch_csv_workers import run_both, torch_reference

__all__: list[str] = []

_MLP = {"layers": 4, "width": 16}


class _Stage:
    """What PyTorch's schedule reads of a stage to build its order (as its own tests stub)."""

    def __init__(self, index: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, 4, 2, 0
        self.submod = None  # no module, so nothing to check for torch.compile


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("torch-csv")
    interleaved, zb = folder / "interleaved.csv", folder / "zb-h1.csv"
    zbv = folder / "zbv.csv"
    ScheduleInterleaved1F1B([_Stage(0), _Stage(2)], 8, loss_fn=F.cross_entropy)._dump_csv(
        str(interleaved))
    ScheduleZBVZeroBubble([_Stage(0), _Stage(3)], 8, loss_fn=F.cross_entropy)._dump_csv(
        str(zbv))
    write_torch_csv(build_schedule([1, 1], ScheduleKind.ZB_H1, 4, 4), zb)
    jobs = {
        "dreampipe": {"model": "mlp", "model_args": _MLP, "schedule": "interleaved-1f1b",
                      "bounds": [0, 1, 2, 3], "replicas": [1] * 4, "virtual_stages": 2,
                      "steps": 3, "minibatch": 16, "microbatches": 8, "optimizer": "sgd",
                      "lr": 0.05, "clip": 0.5, "seed": 3, "schedule_file": str(interleaved)},
        "torch": {"model": "mlp", "model_args": _MLP, "bounds": [0, 2], "microbatches": 4,
                  "minibatch": 16, "lr": 0.1, "seed": 3, "path": str(zb)},
        "zbv": {"model": "mlp", "model_args": _MLP, "schedule": "zbv", "bounds": [0, 1, 2, 3],
                "replicas": [1] * 4, "virtual_stages": 2, "placement": "v", "steps": 3,
                "minibatch": 16, "microbatches": 8, "optimizer": "sgd", "lr": 0.05,
                "clip": 0.5, "seed": 3, "schedule_file": str(zbv)},
    }
    return {"jobs": jobs, "results": run_processes(run_both, 2, jobs, deadline_s=90.0)}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pytorchs_interleaved_schedule_trains_in_a_pipeline_as_one_process(
    runs: dict[str, Any],
) -> None:
    job = runs["jobs"]["dreampipe"]
    assert_matches(runs["results"][0]["dreampipe"], *reference(job))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pytorchs_zbv_schedule_trains_in_a_pipeline_as_one_process(runs: dict[str, Any]) -> None:
    """ScheduleZBVZeroBubble's file (2 ranks, 4 stages in a V, 8 microbatches), clipped."""
    job = runs["jobs"]["zbv"]
    assert_matches(runs["results"][0]["zbv"], *reference(job))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dreampipes_zb_h1_runs_in_pytorchs_runtime_as_one_process(runs: dict[str, Any]) -> None:
    losses, state = torch_reference(runs["jobs"]["torch"])
    first, last = (r["torch"] for r in runs["results"])
    got = {**first["state"], **last["state"]}
    assert sorted(got) == sorted(state)
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=name)
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(losses),
                               rtol=RTOL, atol=ATOL)


def _local(tmp_path: Path, microbatches: int) -> dreampipe.Pipeline:
    """A one-worker Pipeline on a one-stage file of 2 microbatches, in an order no kind
    builds (gpipe runs B1 first)."""
    path = tmp_path / "one.csv"
    path.write_text("0F0,0F1,0B0,0B1\n")
    return dreampipe.Pipeline(
        _model(), example=_batch(0), loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), plan=[],
        config=dreampipe.TrainConfig(schedule="gpipe", microbatches=microbatches,
                                     schedule_file=path))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(k: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(k)
    return torch.randn(8, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def test_a_schedule_file_runs_in_its_order_every_minibatch(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"schedule_file='.*one\.csv' runs 2 microbatches a "
                                          r"minibatch, not microbatches=4; give microbatches=2"):
        _local(tmp_path, 4)
    pipe = _local(tmp_path, 2)
    for k in range(3):
        pipe.step(*_batch(k))
    losses = pipe.finish()
    f, b, step = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.STEP
    assert pipe.runner.schedule.actions[0] == tuple(
        Action(kind, 0, u + 2 * k) if kind is not step else Action(step, 0, k)
        for k in range(3) for kind, u in ((f, 0), (f, 1), (b, 0), (b, 1), (step, 0)))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for k in range(3):
        x, y = _batch(k)
        optimizer.zero_grad()
        loss = (F.cross_entropy(model(x[:4]), y[:4]) + F.cross_entropy(model(x[4:]), y[4:])) / 2
        loss.backward()
        optimizer.step()
        want.append(float(loss.detach()))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=RTOL, atol=ATOL)
    got = pipe.full_state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=name)
    pipe.close()

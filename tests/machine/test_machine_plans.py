"""The plan follows the machine file: an 8-GPU NVLink server against the 2-core dev VM.

Three heavy layers (16 MB of weights each) cut into two stages unevenly
(2 : 1). Where the all-reduce is cheap (NVLink, 150 GB/s) replicating the
whole model is fastest; where it is dear (gloo over loopback on 2 cores,
572 MB/s) a pipeline is, since only activations cross a cut. Both plans
must be the planner's own on the topology each file gives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from dreampipe import Pipeline
from dreampipe.machine.calibration import LocalCalibration, local_topology
from dreampipe.machine.machine_file import ENV_VAR
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.plan import Plan
from dreampipe.planning.planner import plan_pipeline
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.runplan.plan_choice import PlanAsk, choose_plan
from dreampipe.runtime.processes import run_processes
from machine.fixtures import DEV_FILE, DEV_MACHINE, NVLINK_FILE, NVLINK_MACHINE, here_file

__all__: list[str] = []

_HEAVY = LayerGraph(
    tuple(Layer(f"l{i}", 10.0, 20.0, 512 * 1024, 16 << 20) for i in range(3)),
    ((0, 1), (1, 2)), 32, "heavy",
)


def _shape(plan: Plan) -> list[tuple[int, int, int]]:
    return [(st.first, st.last, st.replicas) for st in plan.stages]


def _choose(workers: int, machine: LocalCalibration) -> Plan:
    return choose_plan(_HEAVY, local_topology(workers, machine),
                       PlanAsk(workers=workers, allow_fewer_workers=False)).plan


def test_nvlink_replicates_where_the_dev_vm_pipelines() -> None:
    for workers in (2, 8):
        fast = _choose(workers, NVLINK_MACHINE)
        slow = _choose(workers, DEV_MACHINE)
        assert _shape(fast) == [(0, 2, workers)], fast  # data parallelism
        assert fast.num_stages == 1 and slow.num_stages > 1, (fast, slow)
        for plan, machine in ((fast, NVLINK_MACHINE), (slow, DEV_MACHINE)):
            direct = plan_pipeline(_HEAVY, local_topology(workers, machine),
                                   PlanOptions(allow_fewer_workers=False))
            assert _shape(plan) == _shape(direct)
            assert plan.time_per_minibatch_s == direct.time_per_minibatch_s
    assert _shape(_choose(8, DEV_MACHINE)) \
        == [(0, 0, 3), (1, 1, 3), (2, 2, 2)]


@dataclass(frozen=True)
class _Job:
    machine_file: str
    width: int = 2048
    batch: int = 8


def _auto_plan(rank: int, world: int, job: _Job) -> Plan:
    os.environ[ENV_VAR] = job.machine_file
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(job.width, job.width) for _ in range(3)))
    example = (torch.randn(job.batch, job.width), torch.randn(job.batch, job.width))
    pipe = Pipeline(model, example=example, loss_fn=nn.functional.mse_loss,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.01), plan="auto")
    plan = pipe.plan
    pipe.close()
    return plan


def _planned(source: Path, tmp_path: Path) -> tuple[Plan, LocalCalibration]:
    made_here = here_file(source, tmp_path / source.name)
    plans = run_processes(_auto_plan, 2, _Job(str(made_here)), deadline_s=90.0)
    assert _shape(plans[0]) == _shape(plans[1])  # every rank runs rank 0's plan
    return plans[0], DEV_MACHINE if source == DEV_FILE else NVLINK_MACHINE


@pytest.mark.slow
@pytest.mark.timing  # plans from a profile it measures: alone on the cores (make test)
@pytest.mark.timeout(180)
def test_pipeline_auto_plans_with_the_machine_file(tmp_path: Path) -> None:
    fast, fast_machine = _planned(NVLINK_FILE, tmp_path)
    slow, slow_machine = _planned(DEV_FILE, tmp_path)
    assert _shape(fast) == [(0, 2, 2)], fast  # the whole model on both GPUs
    assert slow.num_stages == 2 and all(st.replicas == 1 for st in slow.stages), slow
    for plan, machine in ((fast, fast_machine), (slow, slow_machine)):
        assert plan.topology == local_topology(2, machine).describe()  # the file's figures
    assert "150.0 GB/s" in fast.topology and "572.0 MB/s" in slow.topology

"""``dreampipe train`` under two torchrun agents (``--nnodes 2``, c10d rendezvous) on 127.0.0.1.

Each agent is one node with one worker, so the pipeline's two stages sit on
two nodes: the plan is made on a 2-level topology (workers inside a node,
nodes as servers), and 1F1B-flush across the nodes equals gradient
accumulation in one process, weights read back from the run's checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from machine.fixtures import DEV_MACHINE
from runtime.reference import reference_sync, sgd
from torchrun import agent_command, run_agents

import dreampipe
from dreampipe.machine.calibration import local_topology
from dreampipe.machine.torchrun import torchrun_nodes
from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset
from dreampipe.runtime.processes import free_port

__all__: list[str] = []

_TESTS = Path(__file__).resolve().parents[1]
_SRC = Path(dreampipe.__file__).resolve().parents[1]
STEPS = 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_plan_on_two_levels_and_equal_gradient_accumulation(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join([str(_SRC), str(_TESTS)])}
    train = ["-m", "dreampipe", "train", "mlp", "--model-arg", "layers=4", "--model-arg",
             "width=16", "--stages", "0,2", "--schedule", "1f1b-flush", "--microbatches", "2",
             "--batch-size", "16", "--steps", str(STEPS), "--checkpoint-dir",
             str(tmp_path / "ck"), "--checkpoint-every", str(STEPS), "--json", "--no-progress",
             "--timeout", "60"]
    cmds = [agent_command(node, nnodes=2, nproc=1, endpoint=f"127.0.0.1:{port}",
                          run_id=f"dp{os.getpid()}", local_addr="127.0.0.1", target=train)
            for node in (0, 1)]
    ran = run_agents(cmds, [env, env], tmp_path, timeout_s=240)
    errs = [err[-3000:] for _, _, err in ran]
    assert [code for code, _, _ in ran] == [0, 0], errs
    lines = [ln for _, out, _ in ran for ln in out.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, (lines, errs)  # rank 0 reports, on whichever node it ran
    got = json.loads(lines[0])
    assert got["topology"].startswith("2x1 = 2 workers ("), got["topology"]  # nodes x per node
    assert got["stages"] == [[0, 1, 1], [2, 3, 1]]
    spec = get_model("mlp", layers=4, width=16)
    losses, state = reference_sync(spec, load_dataset("synthetic", spec, seed=0), steps=STEPS,
                                   minibatch=16, seed=0, opt=sgd(0.01), microbatches=2)
    assert got["losses"] == pytest.approx(losses, rel=1e-5, abs=4e-5)
    weights = dreampipe.load_model_state(tmp_path / "ck")
    assert sorted(weights) == sorted(state)
    for name, value in state.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=4e-5, msg=name)


def test_torchrun_nodes_become_the_outer_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert torchrun_nodes(4) == 2
    two_levels = dataclasses.replace(DEV_MACHINE, outer_bandwidth="10Gbps")
    assert [lv.count for lv in local_topology(4, two_levels, nodes=2).levels] == [2, 2]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # uneven nodes: one level
    assert torchrun_nodes(4) == 1
    assert [lv.count for lv in local_topology(4, DEV_MACHINE, nodes=1).levels] == [4]

"""The same run under torchrun: run_from_env reads torchrun's environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dreampipe.models import get_model
from dreampipe.runtime.data import load_dataset
from dreampipe.runtime.launch import free_port

from .reference import reference_sync, sgd

__all__: list[str] = []


@pytest.mark.timeout(120)
def test_run_from_env_under_torchrun() -> None:
    script = Path(__file__).with_name("torchrun_main.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("{"))
    losses = json.loads(line)["losses"]
    spec = get_model("mlp", layers=4, width=16)
    data = load_dataset("synthetic", spec, seed=3)
    expected, _ = reference_sync(spec, data, steps=3, minibatch=16, seed=3, opt=sgd(0.2))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=4e-5)

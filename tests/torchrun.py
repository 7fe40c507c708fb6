"""Run a script under ``torchrun`` on this machine and read the JSON line it prints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from dreampipe.runtime.launch import free_port

__all__ = ["torchrun_json"]


def torchrun_json(script: Path, *args: str, nproc: int = 2, timeout_s: float = 100.0
                  ) -> dict[str, Any]:
    """``torchrun --nproc-per-node nproc script args``; its first line starting with ``{``.

    One thread per process, a free port; the whole process group is killed
    if it outlives ``timeout_s``, and a failure shows the end of its stderr.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(next(ln for ln in out.splitlines()
                                             if ln.startswith("{")))
    return result

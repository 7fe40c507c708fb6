"""Run a script or ``dreampipe`` under ``torchrun`` on this machine, and clean up after it.

torchrun starts each worker in a session of its own, so ending torchrun's
process group leaves the workers behind: :func:`stop` ends every
descendant, found through ``/proc``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from dreampipe.runtime.processes import free_port

__all__ = ["agent_command", "descendants", "run_agents", "started", "stop", "torchrun_command",
           "torchrun_json", "worker_env"]


def torchrun_command(*target: str, nproc: int = 2, options: Sequence[str] = ()) -> list[str]:
    """``torchrun --nproc-per-node nproc [options] target...`` on a free port of 127.0.0.1."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *options, *target]


def agent_command(node: int, *, nnodes: int, nproc: int, endpoint: str, run_id: str,
                  local_addr: str, target: Sequence[str]) -> list[str]:
    """The torchrun agent of node ``node`` of ``nnodes`` (``nproc`` workers each, no
    restarts), meeting the others at the c10d rendezvous ``endpoint`` that node 0 hosts."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc), "--node-rank", str(node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf",
            f"is_host={int(node == 0)}", "--local-addr", local_addr, "--max-restarts", "0",
            *target]


def run_agents(commands: Sequence[list[str]], envs: Sequence[dict[str, str]], folder: Path, *,
               timeout_s: float, tag: str = "") -> list[tuple[int, str, str]]:
    """Start every command at once (the agents of one job), each in a session of its own
    with its output in ``folder/<tag>out<n>`` and ``err<n>``; wait for all within one
    deadline of ``timeout_s``, stop whatever still runs on the way out. Per command: its
    exit status, stdout and stderr. Past the deadline the failure shows every agent's
    stderr."""
    agents: list[subprocess.Popen[bytes]] = []
    files = [(folder / f"{tag}out{n}", folder / f"{tag}err{n}") for n in range(len(commands))]
    deadline = time.monotonic() + timeout_s
    try:
        for cmd, env, (out_path, err_path) in zip(commands, envs, files, strict=True):
            with out_path.open("wb") as out, err_path.open("wb") as err:
                agents.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env,
                                               cwd=folder, start_new_session=True))
        try:
            codes = [agent.wait(timeout=max(0.0, deadline - time.monotonic()))
                     for agent in agents]
        except subprocess.TimeoutExpired:
            tails = [err.read_text(errors="replace")[-3000:] for _, err in files]
            raise AssertionError(f"the agents ran past {timeout_s:g} s; their stderr:\n"
                                 + "\n----\n".join(tails)) from None
    finally:
        for agent in agents:
            stop(agent)
    return [(code, out.read_text(errors="replace"), err.read_text(errors="replace"))
            for code, (out, err) in zip(codes, files, strict=True)]


def _env() -> dict[str, str]:
    """One thread per process; PYTHONFAULTHANDLER: a rank killed by a signal prints its stacks."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first), from ``/proc/*/stat``."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it exited while we looked
            continue
        parent[int(stat.parent.name)] = int(text.rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        kids = [p for p, pp in parent.items() if pp == todo[0]]
        found += kids
        todo = todo[1:] + kids
    return found


def worker_env(pid: int) -> dict[str, str]:
    """The environment a process started with (empty if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def stop(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc`` if it still runs: its process group and every process below it."""
    if proc.poll() is not None:  # reaped: its pid may be another's now
        return
    below = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in below:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


@contextmanager
def started(cmd: list[str], out: Path, cwd: Path | None = None
            ) -> Iterator[subprocess.Popen[str]]:
    """``cmd`` in a new session, its output in ``out``.stdout/.stderr; stopped on the way out."""
    with (out.with_suffix(".stdout").open("w") as stdout,
          out.with_suffix(".stderr").open("w") as stderr):
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, env=_env(),
                                cwd=cwd, start_new_session=True)
        try:
            yield proc
        finally:
            stop(proc)


def torchrun_json(script: Path, *args: str, nproc: int = 2, timeout_s: float = 100.0
                  ) -> dict[str, Any]:
    """``torchrun --nproc-per-node nproc script args``; its first line starting with ``{``.

    One thread per process, a free port; every process is killed if the run
    outlives ``timeout_s``, and a failure shows the end of its stderr.
    """
    proc = subprocess.Popen(torchrun_command(str(script), *args, nproc=nproc),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        stop(proc)
    assert proc.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(next(ln for ln in out.splitlines()
                                             if ln.startswith("{")))
    return result

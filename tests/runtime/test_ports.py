"""A rendezvous port (:mod:`dreampipe.runtime.ports`), and a launch that loses its port to
another process starting again on another (:func:`~dreampipe.runtime.processes.run_processes`)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dreampipe.errors import WorkerError
from dreampipe.runtime import ports
from dreampipe.runtime.ports import free_port
from dreampipe.runtime.processes import run_processes

__all__: list[str] = []


def test_a_free_port_binds_and_lies_below_the_ephemeral_range() -> None:
    low = ports._ephemeral_low()
    got = {free_port() for _ in range(20)}
    assert all(ports._LOWEST_PORT <= p < low for p in got)
    assert len(got) > 10  # drawn, not the kernel's next one again and again
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", got.pop()))


def _loses_its_port_once(rank: int, world: int, marker: str) -> int:
    """Rank 0 fails as a taken rendezvous port fails the first time, then runs."""
    if rank == 0 and not Path(marker).exists():
        Path(marker).touch()
        raise RuntimeError("The server socket has failed to listen: EADDRINUSE")
    return rank * 10


def _fails(rank: int, world: int, marker: str) -> int:
    Path(marker).touch()
    raise RuntimeError(f"rank {rank} broke")


def test_a_launch_whose_port_was_taken_starts_again_and_no_other_failure_does(
        tmp_path: Path) -> None:
    marker = tmp_path / "lost"
    assert run_processes(_loses_its_port_once, 2, str(marker), deadline_s=60) == [0, 10]
    assert marker.exists()
    again = tmp_path / "broke"
    with pytest.raises(WorkerError, match=r"rank [01] broke"):
        run_processes(_fails, 2, str(again), deadline_s=60)

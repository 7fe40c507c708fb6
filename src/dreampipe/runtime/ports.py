"""A free local port for a rendezvous: :func:`free_port`."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (for a local rendezvous).

    Drawn at random below the kernel's ephemeral range: the kernel hands a port it just
    released to the next ``bind`` to port 0, and gloo's connections take theirs from that
    range, so two jobs starting at once (parallel tests) could both be given one port."""
    low = _ephemeral_low()
    for _ in range(64):
        port = _random.randrange(_LOWEST_PORT, low) if low > _LOWEST_PORT + 1 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The lowest port :func:`free_port` draws; below it sit well-known services.
_LOWEST_PORT = 10000
_random = random.SystemRandom()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768

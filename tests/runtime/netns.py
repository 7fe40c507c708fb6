"""Two network namespaces joined by a veth pair, each end shaped by ``tc`` tbf.

Needs root, ``ip`` (iproute2) with ``netns`` and ``tc``; :func:`unavailable`
says why not when they are missing, so a test can skip. Names carry the
caller's tag (the test's pid), so concurrent runs never share a namespace,
and :func:`veth_pair` removes both namespaces (and with them the veth pair
and every process still running inside) however its block ends::

    ┌── netns <tag>a ──────┐           ┌── netns <tag>b ──────┐
    │  <tag>a  10.77.0.1 ──┼── veth ───┼── 10.77.0.2  <tag>b  │
    │  tbf rate R (egress) │           │  tbf rate R (egress) │
    └──────────────────────┘           └──────────────────────┘

A tbf qdisc shapes only what leaves an interface, so shaping both ends
gives a full-duplex link of ``R`` each way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

__all__ = ["VethPair", "pair_or_skip", "unavailable", "veth_pair", "wait_ranks"]

_SUBNET = "10.77.0"
_CMD_TIMEOUT_S = 10.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=_CMD_TIMEOUT_S)


def unavailable() -> str | None:
    """Why this machine cannot make namespaces (a reason to skip), or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    name = f"dpchk{os.getpid()}"
    try:
        made = _ip("netns", "add", name, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"'ip netns add' failed: {exc}"
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass(frozen=True)
class VethPair:
    """Side 0 and side 1 of the link: namespace, interface and IPv4 address of each."""

    namespaces: tuple[str, str]
    interfaces: tuple[str, str]
    addresses: tuple[str, str]

    def exec_prefix(self, side: int) -> list[str]:
        """Prepend to a command to run it inside side ``side``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[side]]

    def shape(
        self, rate_bytes_per_s: float | None, *, burst_s: float = 1e-3, latency_ms: float = 100.0
    ) -> None:
        """Shape both ends with tbf at ``rate_bytes_per_s`` each way; None removes the shaping.

        The bucket holds ``burst_s`` of traffic, at least 256 KB (a 64 KB GSO
        packet must fit, and at high rates the timer must not starve the link); the
        queue holds ``latency_ms`` of traffic, so TCP is paced without drops
        on a link this short.
        """
        for ns, dev in zip(self.namespaces, self.interfaces, strict=True):
            if rate_bytes_per_s is None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev,
                                "root"], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
                continue
            rate = int(rate_bytes_per_s)
            burst = max(256 * 1024, int(rate * burst_s))
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", f"{rate}bps", "burst", str(burst), "latency", f"{latency_ms:g}ms"],
                capture_output=True, text=True, check=True, timeout=_CMD_TIMEOUT_S,
            )

    def rank_env(self, rank: int, port: int = 29500) -> dict[str, str]:
        """The environment of rank ``rank`` (0 or 1) of a 2-rank gloo job on this link,
        one thread a process."""
        return {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                "MASTER_ADDR": self.addresses[0], "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": self.interfaces[rank], "OMP_NUM_THREADS": "1"}

    def qdiscs(self) -> list[str]:
        """``tc qdisc show`` of both ends, for messages."""
        out = []
        for ns, dev in zip(self.namespaces, self.interfaces, strict=True):
            shown = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                   capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
            out.append(f"{ns}/{dev}: {shown.stdout.strip()}")
        return out


@contextlib.contextmanager
def veth_pair(tag: str, *, mtu: int | None = None) -> Iterator[VethPair]:
    """Two fresh namespaces ``<tag>a``/``<tag>b`` joined by veth ``<tag>a``-``<tag>b``.

    ``tag`` must be short (interface names have at most 15 characters) and
    unique to the caller. Everything is removed on the way out, processes
    left inside the namespaces killed first.
    """
    if len(tag) > 14:
        raise ValueError(f"tag {tag!r} is too long for an interface name (14 characters at most)")
    pair = VethPair((f"{tag}a", f"{tag}b"), (f"{tag}a", f"{tag}b"),
                    (f"{_SUBNET}.1", f"{_SUBNET}.2"))
    made: list[str] = []
    try:
        for ns in pair.namespaces:
            _ip("netns", "add", ns)
            made.append(ns)
        a, b = pair.interfaces
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        for ns, dev, addr in zip(pair.namespaces, pair.interfaces, pair.addresses, strict=True):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            if mtu is not None:
                _ip("-n", ns, "link", "set", dev, "mtu", str(mtu))
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield pair
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{' '.join(exc.cmd)} failed: {exc.stderr}") from exc
    finally:
        for ns in made:
            kill_inside(ns)
            _ip("netns", "del", ns, check=False)
        # the veth pair goes with its namespace; if it never got there, remove it here
        _ip("link", "del", pair.interfaces[0], check=False)


def pair_or_skip(tag: str) -> Iterator[VethPair]:
    """:func:`veth_pair` for a fixture to yield from; the test skips where this machine
    cannot make namespaces (:func:`unavailable`)."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with veth_pair(tag) as pair:
        yield pair


def wait_ranks(procs: list[subprocess.Popen[bytes]], limit_s: float, grace_s: float = 3.0
               ) -> list[int | None]:
    """Wait for every process (each in a session of its own) to exit; past ``limit_s``,
    or ``grace_s`` after one failed, kill those left. Their exit codes."""
    deadline = time.monotonic() + limit_s
    failed_at: float | None = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if any(p.returncode not in (None, 0) for p in procs):
                failed_at = failed_at or now
            if now > deadline or (failed_at is not None and now > failed_at + grace_s):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs]


def kill_inside(namespace: str) -> None:
    """SIGKILL every process running in ``namespace`` (ours: the namespace is)."""
    try:
        pids = _ip("netns", "pids", namespace, check=False).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)
    if pids:
        time.sleep(0.1)

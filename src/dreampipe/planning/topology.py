"""Topology: the cluster as a hierarchy of levels, innermost first.

Level k groups ``count`` units of level k-1 joined by links of ``bandwidth``
bytes/s per direction and ``latency`` seconds per message (the alpha-beta
model). ``4x4`` is 4 servers of 4 devices:
``levels = (Level(4, in-server), Level(4, between servers))``. Workers are
numbered so that the devices of one server are consecutive. The bandwidth of
an outer level is that of one unit's link (a server's NIC), which everything
the unit sends across that level shares (docs/design.md §3.1).
:data:`PRESETS` are PipeDream's clusters; ``NAME:N`` is ``N`` servers of a
model in :data:`SERVERS` (``dgx-a100:2``). A preset names its device
(:class:`~dreampipe.profiling.devices.Device`), which times profiles by shape.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from dreampipe.errors import TopologyError
from dreampipe.profiling.devices import A100_80GB, V100_16GB, V100_32GB, Device
from dreampipe.quantities import (
    format_bytes,
    format_duration,
    parse_bandwidth,
    parse_bytes,
    parse_duration,
)

__all__ = ["DEFAULT_BANDWIDTHS", "DEFAULT_LATENCIES", "PRESETS", "SERVERS", "Level", "Server",
           "Topology"]

#: Used by :meth:`Topology.parse` when no bandwidths are given: innermost level
#: PCIe (10 GB/s), every outer level 10 Gbps Ethernet.
DEFAULT_BANDWIDTHS = ("10GB/s", "10Gbps")
#: Per-message latency of each level when none is given: innermost 10 us,
#: every outer level 50 us, the order of a small NCCL or gloo message.
DEFAULT_LATENCIES = ("10us", "50us")
#: The slowest link a level may have, in bytes/s.
_MIN_BANDWIDTH = 1.0


@dataclass(frozen=True)
class Level:
    """``count`` units of the level below, joined by links of ``bandwidth`` bytes/s
    and ``latency`` seconds per message."""

    count: int
    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.latency < math.inf):
            raise TopologyError(
                f"latency {self.latency!r} s must be finite and >= 0; give e.g. 10us"
            )
        if self.count < 1:
            raise TopologyError(f"a level needs at least 1 unit, got {self.count}")
        if not (self.bandwidth >= _MIN_BANDWIDTH and math.isfinite(self.bandwidth)):
            raise TopologyError(
                f"bandwidth {self.bandwidth!r} bytes/s must be positive and finite, at least "
                "1 byte/s (slower links overflow the cost model); give e.g. 10Gbps"
            )


@dataclass(frozen=True)
class Topology:
    """Levels innermost first, device memory, a name, and the device where known.

    ``memory_bytes`` is the memory per worker the planner holds stages to
    (a preset's device's unless ``memory`` overrides it); ``device`` times
    profiles by shape (None for a bare shape such as ``4x4``).

    ``overlap`` says whether communication overlaps compute: True for
    devices with their own copy engines and network cards (GPUs); False
    where the workers' communication runs on the cores that compute (CPU
    workers on one machine, gloo over loopback), so that a gradient
    all-reduce costs its time after the backward instead of hiding in it.
    """

    levels: tuple[Level, ...]
    memory_bytes: int = 16 * 10**9
    name: str = ""
    overlap: bool = True
    device: Device | None = None

    def __post_init__(self) -> None:
        if not self.levels:
            raise TopologyError("a topology needs at least one level")
        if self.memory_bytes <= 0:
            raise TopologyError(f"device memory {self.memory_bytes} must be positive")

    @property
    def num_workers(self) -> int:
        return math.prod(level.count for level in self.levels)

    @property
    def shape(self) -> str:
        """``"4x4"`` style, outermost first."""
        return "x".join(str(level.count) for level in reversed(self.levels))

    def bandwidth_between(self, a: int, b: int) -> float:
        """Bandwidth of the slowest link between workers ``a`` and ``b``."""
        if a == b:
            return math.inf
        size = 1
        for level in self.levels:
            size *= level.count
            if a // size == b // size:
                return level.bandwidth
        return self.levels[-1].bandwidth

    def level_between(self, a: int, b: int) -> int:
        """The outermost level the path between workers ``a != b`` crosses."""
        size = 1
        for k, level in enumerate(self.levels):
            size *= level.count
            if a // size == b // size:
                return k
        return len(self.levels) - 1

    def links_between(self, a: int, b: int) -> tuple[tuple[int, int, int], ...]:
        """The links a transfer from worker ``a`` to worker ``b != a`` holds.

        Inside a server (level 0) the pair's own directed link, ``(0, a, b)``.
        Across an outer level ``k`` the sending unit's link out, ``(k, 0, unit)``,
        and the receiving unit's link in, ``(k, 1, unit)``, which every transfer
        of those units across level ``k`` shares (§3.1 of docs/design.md).
        """
        k = self.level_between(a, b)
        if k == 0:
            return ((0, a, b),)
        size = math.prod(level.count for level in self.levels[:k])
        return (k, 0, a // size), (k, 1, b // size)

    def flat(self) -> Topology:
        """One level of all workers at the slowest bandwidth and the largest latency."""
        bw = min(level.bandwidth for level in self.levels)
        lat = max(level.latency for level in self.levels)
        return dataclasses.replace(self, levels=(Level(self.num_workers, bw, lat),))

    def describe(self) -> str:
        parts = [f"{lv.count} @ {format_bytes(lv.bandwidth)}/s"
                 + (f" {format_duration(lv.latency)}" if lv.latency else "")
                 for lv in reversed(self.levels)]
        label = f"{self.name} " if self.name else ""
        device = f" ({self.device.describe()})" if self.device else ""
        return (f"{label}{self.shape} = {self.num_workers} workers "
                f"({' x '.join(parts)}), {format_bytes(self.memory_bytes)} each{device}")

    @classmethod
    def parse(
        cls,
        spec: str,
        bandwidths: Sequence[str | float] | None = None,
        memory: str | int | None = None,
        latencies: Sequence[str | float] | None = None,
    ) -> Topology:
        """A preset name, servers ``"dgx-a100:2"``, or ``"4x4"`` / ``"16"`` (outermost first).

        ``bandwidths`` lists one figure per level, innermost first: a string
        with its unit (``"10GB/s"``, ``"10Gbps"``; a bare ``"10"`` is an error)
        or a number of bytes/s. A shape needs one per level, or none for
        :data:`DEFAULT_BANDWIDTHS` (the last repeated outwards); a preset may
        override only its inner levels, the outer ones keeping the preset's.
        ``memory`` overrides the device memory (``"16GB"``). ``latencies``
        works as ``bandwidths`` does (``"10us"``; default
        :data:`DEFAULT_LATENCIES`, the last repeated outwards).
        """
        spec = spec.strip()
        preset = PRESETS.get(spec) or _servers(spec)
        if preset is not None:
            topo = preset
            if bandwidths:
                known = [lv.bandwidth for lv in preset.levels]
                figures = _parse_bandwidths(bandwidths, len(known), spec)
                topo = dataclasses.replace(preset, levels=tuple(
                    Level(lv.count, bw, lv.latency) for lv, bw in
                    zip(preset.levels, figures + known[len(figures):], strict=True)))
        elif re.fullmatch(r"\d+(x\d+)*", spec):
            counts = [int(x) for x in reversed(spec.split("x"))]
            if any(c < 1 for c in counts):
                raise TopologyError(
                    f"topology {spec!r} has a level of 0 workers; every count must be >= 1"
                )
            if bandwidths:
                figures = _parse_bandwidths(bandwidths, len(counts), spec)
                if len(figures) < len(counts):
                    raise TopologyError(
                        f"topology {spec!r} has {len(counts)} levels, so it needs "
                        f"{len(counts)} bandwidths, one per level, innermost first "
                        f"(e.g. {_example(len(counts))}); got {len(figures)}: {list(bandwidths)}"
                    )
            else:
                defaults = DEFAULT_BANDWIDTHS[: len(counts)]
                figures = [parse_bandwidth(b) for b in defaults]
                figures += figures[-1:] * (len(counts) - len(figures))
            lats = _default_latencies(len(counts))
            topo = cls(tuple(Level(c, bw, lat)
                             for c, bw, lat in zip(counts, figures, lats, strict=True)))
        else:
            raise TopologyError(
                f"unknown topology {spec!r}; use a preset ({', '.join(sorted(PRESETS))}), "
                f"servers ({', '.join(f'{name}:N' for name in SERVERS)}) "
                "or a shape like 16, 4x4 or 2x8"
            )
        if latencies:
            figures = _parse_latencies(latencies, len(topo.levels), spec)
            lats = figures + [lv.latency for lv in topo.levels[len(figures):]]
            topo = dataclasses.replace(topo, levels=tuple(
                Level(lv.count, lv.bandwidth, lat) for lv, lat in zip(topo.levels, lats,
                                                                      strict=True)))
        if memory is not None:
            try:
                mem = parse_bytes(memory, require_unit=True)
            except ValueError as exc:
                raise TopologyError(str(exc)) from None
            topo = dataclasses.replace(topo, memory_bytes=mem)
        return topo


def _example(levels: int) -> str:
    """Bandwidths to suggest for ``levels`` levels, innermost first."""
    return " then ".join(["10GB/s", *["10Gbps"] * (levels - 1)])


def _parse_bandwidths(
    bandwidths: Sequence[str | float], levels: int, spec: str
) -> list[float]:
    """Each figure in bytes/s (strings need a unit); at most one per level."""
    try:
        figures = [parse_bandwidth(b, require_unit=True) for b in bandwidths]
    except ValueError as exc:
        raise TopologyError(str(exc)) from None
    for text, figure in zip(bandwidths, figures, strict=True):
        if figure < _MIN_BANDWIDTH:
            raise TopologyError(
                f"bandwidth {text!r} is {figure:g} bytes/s, below 1 byte/s, the slowest link "
                "the cost model takes; give e.g. 10Gbps"
            )
    if len(figures) > levels:
        raise TopologyError(
            f"{len(figures)} bandwidths for {levels} levels of topology {spec!r}; "
            "give one per level, innermost first"
        )
    return figures


def _default_latencies(levels: int) -> list[float]:
    """:data:`DEFAULT_LATENCIES` for ``levels`` levels, the last repeated outwards."""
    figures = [parse_duration(x) for x in DEFAULT_LATENCIES[:levels]]
    return figures + figures[-1:] * (levels - len(figures))


def _parse_latencies(latencies: Sequence[str | float], levels: int, spec: str) -> list[float]:
    """Each latency in seconds (strings need a unit); at most one per level."""
    try:
        figures = [parse_duration(x, require_unit=True) for x in latencies]
    except ValueError as exc:
        raise TopologyError(str(exc)) from None
    if len(figures) > levels:
        raise TopologyError(
            f"{len(figures)} latencies for {levels} levels of topology {spec!r}; "
            "give one per level, innermost first"
        )
    return figures


@dataclass(frozen=True)
class Server:
    """A server model: ``devices`` of ``device`` joined at ``inside`` per device and
    direction, and ``outside`` per direction from the server to the others (all its
    network links together, which everything the server sends out shares)."""

    device: Device
    devices: int
    inside: str
    outside: str

    def topology(self, servers: int, name: str) -> Topology:
        """``servers`` of them, at the default latencies."""
        return _preset(name, [self.devices, servers], [self.inside, self.outside], self.device)


#: Server models for ``NAME:N`` (``N`` servers); bandwidths per direction:
#:
#: ============ ================= ============================== ============================
#: name         devices           inside (per device)            outside (per server)
#: ============ ================= ============================== ============================
#: dgx-a100     8 A100 80 GB      NVSwitch 300 GB/s              8 x 200 Gbps HDR InfiniBand
#: dgx-2h       16 V100 32 GB     NVSwitch 150 GB/s              8 x 100 Gbps EDR InfiniBand
#: p3.16xlarge  8 V100 16 GB      NVLink 50 GB/s                 25 Gbps
#: ============ ================= ============================== ============================
#:
#: dgx-2h is Megatron-LM's server (Shoeybi et al. 2019: "300 GB/sec" between GPUs, both
#: directions, and 100 GB/s between servers over 8 InfiniBand adapters); p3.16xlarge is
#: PipeDream's cluster-b server (AWS), with cluster-b's figures.
SERVERS: dict[str, Server] = {
    "dgx-a100": Server(A100_80GB, 8, "300GB/s", "1600Gbps"),
    "dgx-2h": Server(V100_32GB, 16, "150GB/s", "800Gbps"),
    "p3.16xlarge": Server(V100_16GB, 8, "50GB/s", "25Gbps"),
}


def _servers(spec: str) -> Topology | None:
    """``NAME:N``: ``N`` servers of :data:`SERVERS`' ``NAME``; None if ``spec`` names none."""
    name, colon, count = spec.partition(":")
    if name not in SERVERS:
        return None
    if not colon:
        raise TopologyError(f"topology {spec!r} needs its number of servers: {name}:N, "
                            f"e.g. {name}:2")
    if not re.fullmatch(r"\d+", count) or int(count) < 1:
        raise TopologyError(f"topology {spec!r}: {count!r} is not a whole number of servers "
                            f">= 1; write e.g. {name}:2")
    return SERVERS[name].topology(int(count), spec)


def _preset(name: str, counts: Sequence[int], bws: Sequence[str], device: Device | None,
            memory: str = "") -> Topology:
    """A cluster of ``device`` at the default latencies, or of ``memory`` per worker where it
    names no device."""
    lats = _default_latencies(len(counts))
    levels = tuple(Level(c, parse_bandwidth(b), lat)
                   for c, b, lat in zip(counts, bws, lats, strict=True))
    mem = device.memory_bytes if device else parse_bytes(memory)
    return Topology(levels, mem, name, device=device)


#: PipeDream's clusters (its paper's Table 2); bandwidths effective, per direction, per link:
#:
#: ========== ===================================== ============ =============
#: preset     hardware                              in a server  between
#: ========== ===================================== ============ =============
#: cluster-a  4 servers x 4 V100 16 GB, PCIe          10 GB/s      10 Gbps
#: cluster-b  2 servers x 8 V100 16 GB, NVLink        50 GB/s      25 Gbps
#: cluster-c  4 servers x 1 Titan X 12 GB             --           40 Gbps
#: ========== ===================================== ============ =============
#:
#: 10 GB/s is what a PCIe 3.0 x16 link sustains in practice; 50 GB/s is one
#: V100 NVLink 2.0 brick pair (2 x 25 GB/s) per direction. cluster-b is
#: ``p3.16xlarge:2``. cluster-c names no device (a Titan X has no 16-bit tensor
#: cores), so profiles by shape are not timed on it.
PRESETS: dict[str, Topology] = {
    "cluster-a": _preset("cluster-a", [4, 4], ["10GB/s", "10Gbps"], V100_16GB),
    "cluster-b": SERVERS["p3.16xlarge"].topology(2, "cluster-b"),
    "cluster-c": _preset("cluster-c", [1, 4], ["40Gbps", "40Gbps"], None, "12GB"),
}

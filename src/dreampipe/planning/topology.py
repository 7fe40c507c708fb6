"""Topology: the cluster as a hierarchy of levels, innermost first.

Level k groups ``count`` units of level k-1 joined by links of ``bandwidth``
bytes/s per direction and ``latency`` seconds per message (the alpha-beta
model). ``4x4`` is 4 servers of 4 devices:
``levels = (Level(4, in-server), Level(4, between servers))``. Workers are
numbered so that the devices of one server are consecutive. The bandwidth of
an outer level is that of one unit's link (a server's NIC), which everything
the unit sends across that level shares (docs/design.md §3.1).
:data:`PRESETS` are PipeDream's clusters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from dreampipe.errors import TopologyError
from dreampipe.quantities import (
    format_bytes,
    format_duration,
    parse_bandwidth,
    parse_bytes,
    parse_duration,
)

__all__ = ["DEFAULT_BANDWIDTHS", "DEFAULT_LATENCIES", "PRESETS", "Level", "Topology"]

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
    """Levels innermost first, device memory, a name.

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

    def flat(self) -> Topology:
        """One level of all workers at the slowest bandwidth and the largest latency."""
        bw = min(level.bandwidth for level in self.levels)
        lat = max(level.latency for level in self.levels)
        return Topology((Level(self.num_workers, bw, lat),), self.memory_bytes, self.name,
                        self.overlap)

    def describe(self) -> str:
        parts = [f"{lv.count} @ {format_bytes(lv.bandwidth)}/s"
                 + (f" {format_duration(lv.latency)}" if lv.latency else "")
                 for lv in reversed(self.levels)]
        label = f"{self.name} " if self.name else ""
        return (f"{label}{self.shape} = {self.num_workers} workers "
                f"({' x '.join(parts)}), {format_bytes(self.memory_bytes)} each")

    @classmethod
    def parse(
        cls,
        spec: str,
        bandwidths: Sequence[str | float] | None = None,
        memory: str | int | None = None,
        latencies: Sequence[str | float] | None = None,
    ) -> Topology:
        """A preset name, or ``"4x4"`` / ``"16"`` (outermost first).

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
        if spec in PRESETS:
            preset = PRESETS[spec]
            topo = preset
            if bandwidths:
                known = [lv.bandwidth for lv in preset.levels]
                figures = _parse_bandwidths(bandwidths, len(known), spec)
                topo = cls(
                    tuple(Level(lv.count, bw) for lv, bw in
                          zip(preset.levels, figures + known[len(figures):], strict=True)),
                    preset.memory_bytes, spec,
                )
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
                f"unknown topology {spec!r}; use a preset ({', '.join(sorted(PRESETS))}) "
                "or a shape like 16, 4x4 or 2x8"
            )
        if latencies:
            figures = _parse_latencies(latencies, len(topo.levels), spec)
            lats = figures + [lv.latency for lv in topo.levels[len(figures):]]
            topo = cls(tuple(Level(lv.count, lv.bandwidth, lat)
                             for lv, lat in zip(topo.levels, lats, strict=True)),
                       topo.memory_bytes, topo.name)
        if memory is not None:
            try:
                mem = parse_bytes(memory)
            except ValueError as exc:
                raise TopologyError(str(exc)) from None
            topo = cls(topo.levels, mem, topo.name)
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


def _preset(name: str, counts: Sequence[int], bws: Sequence[str], memory: str) -> Topology:
    lats = _default_latencies(len(counts))
    levels = tuple(Level(c, parse_bandwidth(b), lat)
                   for c, b, lat in zip(counts, bws, lats, strict=True))
    return Topology(levels, parse_bytes(memory), name)


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
#: V100 NVLink 2.0 brick pair (2 x 25 GB/s) per direction.
PRESETS: dict[str, Topology] = {
    "cluster-a": _preset("cluster-a", [4, 4], ["10GB/s", "10Gbps"], "16GB"),
    "cluster-b": _preset("cluster-b", [8, 2], ["50GB/s", "25Gbps"], "16GB"),
    "cluster-c": _preset("cluster-c", [1, 4], ["40Gbps", "40Gbps"], "12GB"),
}
